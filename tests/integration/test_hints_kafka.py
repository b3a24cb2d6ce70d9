"""Index hints through the real Kafka broker: a hint wakes the tier's consumer, garbage on
the topic is skipped and counted, another tier's topic wakes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiokafka import AIOKafkaProducer

from services.indexer.queue.hints import HintConsumer, HintStats, SkipReason
from services.indexer.queue.hints_kafka import KafkaHintSource
from services.runtime.messaging.avro import MAGIC, default_registry
from services.runtime.messaging.events import INDEX_TASK_CREATED, index_hints_topic
from services.runtime.settings import RuntimeSettings
from tests.support.kafka import create_topics

pytestmark = pytest.mark.integration


def hint_payload(tier: str) -> bytes:
    return default_registry().encode(
        INDEX_TASK_CREATED,
        {
            "eventId": uuid.uuid4(),
            "tenantId": "acme",
            "tier": tier,
            "documentId": uuid.uuid4(),
            "versionNumber": 1,
            "taskId": uuid.uuid4(),
            "taskType": "INDEX_VERSION",
            "occurredAt": datetime.now(UTC),
        },
    )


class Waker:
    def __init__(self) -> None:
        self.woken = asyncio.Event()
        self.changed = asyncio.Event()  # the consumer handled a batch or changed state
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        self.woken.set()


@contextlib.asynccontextmanager
async def consuming(
    settings: RuntimeSettings, tier: str, waker: Waker
) -> AsyncIterator[HintConsumer]:
    connected = asyncio.Event()

    def on_change(stats: HintStats) -> None:
        if stats.connected:
            connected.set()
        waker.changed.set()

    async def connect() -> KafkaHintSource:
        source = await KafkaHintSource.connect(settings, tier)
        # connect waits until the group assigned partitions and fixed their positions.
        assert await source.joined()
        return source

    consumer = HintConsumer(
        tier=tier, wake=waker, connect=connect, read_timeout_seconds=0.1, on_change=on_change
    )
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        async with asyncio.timeout(30):
            await connected.wait()
        yield consumer
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task


async def send(settings: RuntimeSettings, tier: str, *values: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(
                index_hints_topic(tier, settings.kafka_topic_prefix), value, key=b"acme/doc"
            )
    finally:
        await producer.stop()


async def test_a_hint_wakes_and_garbage_is_counted_and_skipped(settings: RuntimeSettings) -> None:
    topics = [index_hints_topic(t, settings.kafka_topic_prefix) for t in ("standard", "premium")]
    await create_topics(settings.kafka_bootstrap_servers, topics)
    standard, premium = Waker(), Waker()
    async with (
        consuming(settings, "standard", standard) as hints,
        consuming(settings, "premium", premium) as other,
    ):
        await send(
            settings,
            "standard",
            os.urandom(100),  # random bytes
            MAGIC + b"\x01" * 8 + b"body",  # a fingerprint no schema has
            b"z" * 200_000,  # huge
            hint_payload("standard"),
        )
        async with asyncio.timeout(30):
            await standard.woken.wait()
            while hints.stats.received < 4:
                standard.changed.clear()
                await standard.changed.wait()
        assert hints.stats.skipped == {
            SkipReason.UNDECODABLE: 1,
            SkipReason.UNKNOWN_FINGERPRINT: 1,
            SkipReason.TOO_LARGE: 1,
        }
        # The consumer kept going after the garbage: a later hint wakes it again.
        standard.woken.clear()
        await send(settings, "standard", hint_payload("standard"))
        async with asyncio.timeout(30):
            await standard.woken.wait()
        assert standard.count == 2
        # Tier A's hints never reach tier B's pool.
        assert premium.count == 0
        assert other.stats.received == 0
