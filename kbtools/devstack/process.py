"""Small process helpers shared by the PostgreSQL and Kafka launchers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is not running.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def port_bindable(host: str, port: int) -> bool:
    """Whether a server could listen on ``port`` now, as the JVM binds (SO_REUSEADDR): False
    while another socket holds it, a listener's or a client connection's that the kernel
    gave that port as its ephemeral end."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        return sock.connect_ex((host, port)) == 0


def run_tool(
    argv: list[str], *, timeout: float, **options: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end, its output captured as text. Its exit status is the caller's
    to judge; ``options`` go to ``subprocess.run`` (cwd, user, env)."""
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, **options
    )


def terminate(pid: int, *, grace_s: float) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        _reap(pid)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    while pid_alive(pid):
        _reap(pid)
        time.sleep(0.05)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def spawn_detached(argv: list[str], output: Path, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` in a session of its own (it outlives the command that started it and
    ignores its Ctrl-C), stdout and stderr appended to ``output``. posix_spawn rather than
    Popen: no Popen object to be collected (and warn) while the child keeps running."""
    return os.posix_spawn(
        argv[0],
        argv,
        dict(os.environ) if env is None else env,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(output), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ],
        setsid=True,
    )


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def runs_on_another_port(name: str, pid: int, port: int, setting: str) -> ConfigError:
    """The error of a start that finds its server running from its data but closed on
    its port: started with another port (an older default, or another ``setting``). A
    second server on the same data would fail or harm it: stop the first."""
    return ConfigError(
        f"{name} already runs from this dev stack (pid {pid}) but does not listen on port "
        f"{port}: it was started with another {setting} (the defaults moved below the "
        "ephemeral range); run `kb dev down`, then `kb dev up`"
    )
