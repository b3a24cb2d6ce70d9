"""`kb relay run` / `kb relay replay` as an operator runs them, killed as a crash would."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from services.relay.settings import RelaySettings
from services.runtime.settings import RuntimeSettings
from tests.support.kafka import TopicReader, publish, relay_topics
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _start_relay(env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            *KB, "relay", "run", env=env, cwd=REPO_ROOT, stdout=out, stderr=out
        )


async def _wait_for_file(path: Path, process: asyncio.subprocess.Process, log: Path) -> None:
    async with asyncio.timeout(60):
        # Another process writes it: polling the file system is the only signal there is.
        while not await asyncio.to_thread(path.exists):
            assert process.returncode is None, "relay exited early; see the log"
            await asyncio.sleep(0.05)


@pytest.fixture
def relay_env(service_env: dict[str, str]) -> dict[str, str]:
    return {
        **service_env,
        "KB_RELAY_PARTITIONS": "1",
        "KB_RELAY_LEASE_SECONDS": "2",
        "KB_RELAY_SEND_TIMEOUT_SECONDS": "1.0",
        "KB_RELAY_POLL_INTERVAL_SECONDS": "0.3",
        "KB_RELAY_BACKOFF_MAX_SECONDS": "0.5",
        "KB_LOG_FORMAT": "json",
    }


@pytest.mark.integration
async def test_kill_9_between_produce_and_progress_commit_delivers_again(
    relay_env: dict[str, str],
    settings: RuntimeSettings,
    conn: asyncpg.Connection[Any],
    tmp_path: Path,
) -> None:
    topics = relay_topics(RelaySettings(kafka_topic_prefix=settings.kafka_topic_prefix))
    committed = [(await publish(conn)).event_id for _ in range(20)]
    paused_file = tmp_path / "acked.json"
    log = tmp_path / "relay.log"
    crashing = await _start_relay(
        {**relay_env, "KB_RELAY_TEST_ONLY_PAUSE_AFTER_ACK": str(paused_file)}, log
    )
    try:
        await _wait_for_file(paused_file, crashing, log)
    finally:
        crashing.send_signal(signal.SIGKILL)
        await crashing.wait()
    acked_before_crash = {*json.loads(paused_file.read_text())}
    assert acked_before_crash, "the paused batch was empty"
    # Kafka has the batch, the progress does not.
    progress = await conn.fetchrow(
        "SELECT delivered_snapshot::text AS d, window_position FROM relay_partition"
    )
    assert progress is not None
    assert dict(progress) == {"d": "1:1:", "window_position": 0}

    committed += [(await publish(conn)).event_id for _ in range(5)]
    metrics_port = _free_port()
    restarted = await _start_relay({**relay_env, "KB_RELAY_METRICS_PORT": str(metrics_port)}, log)
    try:
        async with TopicReader(settings.kafka_bootstrap_servers, topics) as reader:
            await reader.read_event_ids(committed, timeout_s=60)
            # The crashed batch goes out again once the restarted relay owns the lease.
            await reader.read_until(
                lambda seen: all(
                    Counter(str(m.event_id) for m in seen)[e] >= 2 for e in acked_before_crash
                )
            )
        async with httpx.AsyncClient() as client:
            scraped = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert "kb_relay_events_sent_total" in scraped.text
        assert "kb_relay_backlog_rows" in scraped.text
    finally:
        restarted.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(30):
                code = await restarted.wait()
        except TimeoutError:
            restarted.kill()
            await restarted.wait()
            raise
    assert code == 0, "kb relay run did not stop cleanly on SIGTERM; see " + str(log)
    # Nothing lost (and nothing that was never committed): duplicates only.
    assert {m.event_id for m in reader.messages} == set(committed)
    # A clean stop hands the lease back and records where it got to.
    row = await conn.fetchrow("SELECT owner, delivered_snapshot::text AS d FROM relay_partition")
    assert row is not None
    assert row["owner"] is None
    assert row["d"] != "1:1:"


def _kb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KB, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.integration
async def test_replay_command_resends_a_filtered_range(
    relay_env: dict[str, str],
    settings: RuntimeSettings,
    conn: asyncpg.Connection[Any],
) -> None:
    events = [
        await publish(conn, tenant_id="acme" if i % 2 else "globex", event_type="X")
        for i in range(12)
    ]
    low, high = events[2].position, events[9].position
    result = await asyncio.to_thread(
        _kb,
        relay_env,
        "relay",
        "replay",
        "--from",
        str(low),
        "--to",
        str(high),
        "--tenant",
        "acme",
        "--rate",
        "200",
    )
    assert result.returncode == 0, result.stderr
    wanted = {events[i].position for i in range(2, 10) if i % 2}  # acme, in range
    assert result.stdout.strip().startswith(f"replayed {len(wanted)} events")
    topics = relay_topics(RelaySettings(kafka_topic_prefix=settings.kafka_topic_prefix))
    async with TopicReader(settings.kafka_bootstrap_servers, topics) as reader:
        # `kb relay replay` has exited: everything it sent lies before the log's end, so
        # reading to it sees any message too many.
        await reader.read_to_end()
    assert all(m.replay for m in reader.messages)
    assert sorted(m.position for m in reader.messages) == sorted(wanted)
    # No live relay ran: replay left the live progress alone.
    assert await conn.fetchval("SELECT count(*) FROM relay_partition") == 0


def test_replay_bad_input_exits_2_with_a_clear_message() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    result = _kb(env, "relay", "replay", "--from", "abc")
    assert result.returncode == 2, result.stderr
    assert "--from must be an outbox position" in result.stderr
    assert "Traceback" not in result.stderr


def test_sasl_without_a_username_is_a_configuration_error_exit_2() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "KAFKA_SASL"))}
    env |= {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_PASSWORD": "hunter2-not-shown"}
    result = _kb(env, "relay", "run")
    assert result.returncode == 2, result.stderr
    assert "KAFKA_SASL_USERNAME" in result.stderr
    assert "hunter2-not-shown" not in result.stderr
    assert "Traceback" not in result.stderr
