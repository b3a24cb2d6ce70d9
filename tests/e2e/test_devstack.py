"""`kb dev up|down|status` as a user runs it, on ports of its own, killed as a crash would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kbtools.chaos.rig.ports import listen_port
from kbtools.devstack.kafka import SLF4J_BINDER, LocalKafka
from kbtools.devstack.process import cmdline, pid_alive, read_pid
from kbtools.devstack.settings import DevStackSettings
from services.runtime.errors import DependencyUnavailable
from services.runtime.pg.migrations import load_migrations
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]


_TAKEN: set[int] = set()


def _free_port() -> int:
    """Below the ephemeral range: the servers are killed and started again on it."""
    return listen_port(taken=_TAKEN)


@pytest.fixture
def dev_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_DEV_")}
    env.pop("DATABASE_URL", None)
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    env.update(
        KB_DEV_HOME=str(tmp_path / "dev"),
        KB_DEV_PG_PORT=str(_free_port()),
        KB_DEV_KAFKA_PORT=str(_free_port()),
        KB_DEV_KAFKA_CONTROLLER_PORT=str(_free_port()),
    )
    return env


def kb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KB, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _env_lines(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines())


def _kafka_distribution(tmp_path: Path) -> Path:
    """An unpacked-distribution layout (``libs/*.jar``) made of the cached Maven jars."""
    jars = LocalKafka(DevStackSettings()).fetch_jars()
    home = tmp_path / "kafka-dist"
    (home / "libs").mkdir(parents=True)
    for jar in jars.glob("*.jar"):
        (home / "libs" / jar.name).symlink_to(jar)
    return home


def test_up_twice_status_kill_and_down(dev_env: dict[str, str], tmp_path: Path) -> None:
    home = Path(dev_env["KB_DEV_HOME"])
    kafka_home = _kafka_distribution(tmp_path)
    dev_env = {**dev_env, "KAFKA_HOME": str(kafka_home)}
    try:
        first = kb(dev_env, "dev", "up")
        assert first.returncode == 0, first.stderr
        urls = _env_lines(first.stdout)
        # stdout is only the two eval-able lines.
        assert set(urls) == {"DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"}
        assert urls["DATABASE_URL"].endswith(f":{dev_env['KB_DEV_PG_PORT']}/kb")
        assert urls["KAFKA_BOOTSTRAP_SERVERS"] == f"127.0.0.1:{dev_env['KB_DEV_KAFKA_PORT']}"

        kafka_pid = read_pid(home / "kafka" / "kafka.pid")
        assert kafka_pid is not None
        assert f"{kafka_home}/libs/*" in cmdline(kafka_pid), "KAFKA_HOME was not used"
        # Its log is written (the broker's slf4j is bound): the start's INFO lines.
        assert "Kafka Server started" in (home / "kafka" / "server.log").read_text()
        second = kb(dev_env, "dev", "up")
        assert second.returncode == 0, second.stderr
        assert _env_lines(second.stdout) == urls
        assert read_pid(home / "kafka" / "kafka.pid") == kafka_pid, "up twice restarted kafka"

        migrate_env = {**dev_env, **urls}
        migrated = kb(migrate_env, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        assert "0001_knowledge_platform" in migrated.stderr

        status = kb(dev_env, "dev", "status")
        assert status.returncode == 0
        assert _env_lines(status.stdout) == urls

        os.kill(kafka_pid, signal.SIGKILL)
        killed = kb(dev_env, "dev", "status")
        assert killed.returncode == 1
        assert "kafka     dead" in killed.stderr
        assert "KAFKA_BOOTSTRAP_SERVERS" not in killed.stdout

        pg_pid = read_pid(home / "postgres" / "data" / "postmaster.pid")
        assert pg_pid is not None
        os.kill(pg_pid, signal.SIGKILL)
        both = kb(dev_env, "dev", "status")
        assert both.returncode == 1
        assert "postgres  dead" in both.stderr
        assert both.stdout == ""

        revived = kb(dev_env, "dev", "up")
        assert revived.returncode == 0, revived.stderr
        assert _env_lines(revived.stdout) == urls
        # Data survived the crash: the migration is still recorded.
        again = kb(migrate_env, "migrate")
        assert f"0 applied, {len(load_migrations())} already there" in again.stderr
    finally:
        down = kb(dev_env, "dev", "down")
    assert down.returncode == 0, down.stderr
    final = kb(dev_env, "dev", "status")
    assert final.returncode == 1
    assert "postgres  stopped" in final.stderr
    assert "kafka     stopped" in final.stderr
    new_kafka_pid = read_pid(home / "kafka" / "kafka.pid")
    assert new_kafka_pid is None or not pid_alive(new_kafka_pid)


def test_the_resolved_jars_bind_the_brokers_logging() -> None:
    """Kafka's slf4j is 1.7: exactly one jar holds its binder (without one the broker logs
    nothing)."""
    jars = sorted(LocalKafka(DevStackSettings()).fetch_jars().glob("*.jar"))
    assert [jar.name for jar in jars if jar.name.startswith("slf4j-api-1.")], jars
    binders = [jar.name for jar in jars if _holds(jar, SLF4J_BINDER)]
    assert len(binders) == 1, binders


def _holds(jar: Path, name: str) -> bool:
    with zipfile.ZipFile(jar) as archive:
        return name in archive.namelist()


def test_a_failed_broker_start_says_why(tmp_path: Path) -> None:
    """A data dir formatted for another node: the broker exits at start, and the error
    names the reason its log gives."""
    settings = DevStackSettings(
        home=tmp_path / "dev", kafka_port=_free_port(), kafka_controller_port=_free_port()
    )
    kafka = LocalKafka(settings)
    kafka.data_dir.mkdir(parents=True)
    (kafka.data_dir / "meta.properties").write_text(
        "version=1\ncluster.id=AAAAAAAAAAAAAAAAAAAAAA\nnode.id=7\n"
        "directory.id=AAAAAAAAAAAAAAAAAAAAAA\n"
    )
    try:
        with pytest.raises(DependencyUnavailable, match="Stored node id 7"):
            kafka.up()
    finally:
        kafka.down()
    assert " ERROR " in kafka.log_file.read_text()


def test_missing_java_and_maven_give_one_clear_message(
    dev_env: dict[str, str], tmp_path: Path
) -> None:
    # A PATH with python but neither java nor mvn, and a cold jar cache.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**dev_env, "PATH": str(bin_dir), "KB_DEV_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("JAVA_HOME", None)
    env.pop("KAFKA_HOME", None)
    result = kb(env, "dev", "up")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Java 17 or newer is needed" in result.stderr
    assert "KAFKA_BOOTSTRAP_SERVERS" in result.stderr
    kb(dev_env, "dev", "down")

    import shutil

    java_dir = tmp_path / "java-only"
    java_dir.mkdir()
    java = shutil.which("java")
    assert java is not None
    (java_dir / "java").symlink_to(java)
    env["PATH"] = f"{bin_dir}:{java_dir}"
    result = kb(env, "dev", "up")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Maven (mvn) is needed" in result.stderr
    assert "KAFKA_HOME" in result.stderr


def test_storage_format_takes_a_cluster_id_that_starts_with_a_dash(tmp_path: Path) -> None:
    """A random KRaft cluster id is base64url: one in 64 starts with "-", which the storage
    tool's parser once took for an option (a red CI run)."""
    from kbtools.devstack.kafka import find_java

    kafka = LocalKafka(
        DevStackSettings(
            home=tmp_path / "dev", kafka_port=_free_port(), kafka_controller_port=_free_port()
        )
    )
    kafka.dir.mkdir(parents=True)
    kafka._write_config()
    cluster_id = "-" + "A" * 21  # 22 base64url characters, as Kafka's own ids
    kafka.format_storage(find_java(), kafka.classpath(), cluster_id)
    meta = (kafka.data_dir / "meta.properties").read_text()
    assert f"cluster.id={cluster_id}" in meta
