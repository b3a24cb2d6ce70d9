"""Kafka goes away for a while: the relay retries, the backlog shows it, nothing is lost.

The broker here is this test's own (free ports, a tmp KB_DEV_HOME): the shared one is
never stopped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from kbtools.chaos.rig.ports import listen_port
from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.settings import DevStackSettings
from services.runtime.settings import RuntimeSettings
from tests.support.kafka import TopicReader, publish, relay_settings, relay_topics, running_relay

pytestmark = pytest.mark.integration


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _until(check: Any, timeout_s: float = 60.0) -> None:
    # Metrics are pulled, not pushed: polling them is what a scraper does too.
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.1)


async def test_broker_down_then_up_drains_the_backlog(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any], tmp_path: Path
) -> None:
    # Ports below the ephemeral range: the broker is stopped and started again on them.
    taken: set[int] = set()
    kafka = LocalKafka(
        DevStackSettings(
            home=tmp_path / "dev",
            kafka_port=listen_port(taken=taken),
            kafka_controller_port=listen_port(taken=taken),
            kafka_heap_mb=256,
        )
    )
    await asyncio.to_thread(kafka.up)
    try:
        s = relay_settings(
            settings, kafka_bootstrap_servers=kafka.bootstrap, relay_send_timeout_seconds=2.0
        )
        topics = relay_topics(s)
        async with running_relay(s):
            async with TopicReader(kafka.bootstrap, topics) as reader:
                before = [(await publish(conn)).event_id for _ in range(10)]
                await reader.read_event_ids(before)

            await asyncio.to_thread(kafka.down)
            failures = _metric("kb_relay_send_failures_total", code="KafkaTimeoutError")
            during = [(await publish(conn)).event_id for _ in range(20)]
            # The backlog gauge shows the rows piling up, and sends keep failing (retried,
            # not crashing).
            await _until(lambda: _metric("kb_relay_backlog_rows") >= 20)
            await _until(
                lambda: (
                    sum(
                        s.value
                        for m in REGISTRY.collect()
                        if m.name == "kb_relay_send_failures"
                        for s in m.samples
                        if s.name.endswith("_total")
                    )
                    > failures
                )
            )

            await asyncio.to_thread(kafka.up)
            async with TopicReader(kafka.bootstrap, topics) as reader:
                await reader.read_event_ids([*before, *during], timeout_s=90)
            await _until(lambda: _metric("kb_relay_backlog_rows") == 0)
        delivered = {m.event_id for m in reader.messages}
        assert delivered >= {*before, *during}
    finally:
        await asyncio.to_thread(kafka.down)
