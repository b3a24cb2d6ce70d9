"""The dev stack's default ports lie below the kernel's ephemeral range (Linux's default,
32768-60999), where no client connection's local end can hold one while its server is
down; the services' defaults point at them, and a chaos run never draws one. A dev stack
still running on its old ports is not started a second time on the same data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbtools.chaos.rig.ports import RESERVED
from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.postgres import EmbeddedPostgres
from kbtools.devstack.settings import DevStackSettings
from services.runtime.errors import ConfigError
from services.runtime.settings import RuntimeSettings
from tests.support.api import free_port

LINUX_EPHEMERAL_LOW = 32768
PORTS = ("pg_port", "pg_replica_port", "kafka_port", "kafka_controller_port")


def _default(field: str) -> int:
    port: int = DevStackSettings.model_fields[field].default
    return port


@pytest.mark.parametrize("field", PORTS)
def test_a_dev_stack_port_is_below_the_ephemeral_range(field: str) -> None:
    assert 1024 <= _default(field) < LINUX_EPHEMERAL_LOW


def test_the_services_defaults_reach_the_dev_stack() -> None:
    services = RuntimeSettings.model_fields
    assert f"@127.0.0.1:{_default('pg_port')}/" in services["database_url"].default
    assert services["kafka_bootstrap_servers"].default == f"127.0.0.1:{_default('kafka_port')}"


def test_a_chaos_run_never_draws_a_dev_stack_port() -> None:
    assert {_default(field) for field in PORTS} <= RESERVED


def test_a_postgres_running_on_another_port_is_not_started_again(tmp_path: Path) -> None:
    """Its pid file names a live postmaster of its data directory while its port is closed:
    `up` says to stop it first, and leaves its pid file (removing it would let a second
    server start)."""
    server = EmbeddedPostgres(DevStackSettings(home=tmp_path, pg_port=free_port()))
    server.data_dir.mkdir(parents=True)
    pid_file = server.data_dir / "postmaster.pid"
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "-D", str(server.data_dir)],
        stdin=subprocess.PIPE,
    )
    try:
        pid_file.write_text(f"{stand_in.pid}\n{server.data_dir}\n")
        with pytest.raises(ConfigError, match="kb dev down"):
            server.up()
        assert pid_file.exists()
    finally:
        assert stand_in.stdin is not None
        stand_in.stdin.close()
        stand_in.wait()


def test_a_recycled_postmaster_pid_is_not_taken_for_the_server(tmp_path: Path) -> None:
    """A container restarted without `kb dev down`: the pid file's number now belongs to
    another process (this one). The server is dead, and `down` clears its pid file
    without signalling that process."""
    server = EmbeddedPostgres(DevStackSettings(home=tmp_path, pg_port=free_port()))
    server.data_dir.mkdir(parents=True)
    pid_file = server.data_dir / "postmaster.pid"
    pid_file.write_text(f"{os.getpid()}\n{server.data_dir}\n")
    assert server.status().state == "dead"
    server.down()
    assert not pid_file.exists()


def test_a_broker_running_on_another_port_is_not_started_again(tmp_path: Path) -> None:
    kafka = LocalKafka(DevStackSettings(home=tmp_path, kafka_port=free_port()))
    kafka.dir.mkdir(parents=True)
    # A process of ours: its command line names the broker's config file.
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", str(kafka.config_file)],
        stdin=subprocess.PIPE,
    )
    try:
        kafka.pid_file.write_text(f"{stand_in.pid}\n")
        with pytest.raises(ConfigError, match="kb dev down"):
            kafka.up()
    finally:
        assert stand_in.stdin is not None
        stand_in.stdin.close()
        stand_in.wait()
