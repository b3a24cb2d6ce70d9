"""Running the relay and reading what it put on Kafka, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.relay.outbox_pg import PgLeaseStore, PgOutboxSource, PgWakeups, create_relay_pool
from services.relay.relay import AfterAck, Relay
from services.relay.settings import RelaySettings
from services.relay.sink_kafka import KafkaSink
from services.runtime.messaging.events import document_events_topic, index_hints_topic
from services.runtime.messaging.outbox import OutboxEvent, StoredEvent, add_event, aggregate_key
from services.runtime.settings import RuntimeSettings


@dataclass(frozen=True)
class Delivered:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: dict[str, str]

    @property
    def event_id(self) -> uuid.UUID:
        return uuid.UUID(self.headers["event_id"])

    @property
    def position(self) -> int:
        return int(self.headers["outbox_position"])

    @property
    def replay(self) -> bool:
        return self.headers["replay"] == "true"


async def create_topics(bootstrap: str, topics: Iterable[str], partitions: int = 3) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics]
        )
    finally:
        await admin.close()


class TopicReader:
    """Reads every partition of ``topics`` from the beginning (no consumer group) and
    keeps everything it saw in ``messages``, in arrival order."""

    def __init__(self, bootstrap: str, topics: Iterable[str]) -> None:
        self.bootstrap = bootstrap
        self.topics = sorted(topics)
        self.messages: list[Delivered] = []
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> TopicReader:
        # Created up front (already-existing is fine) so the subscription sees them at once.
        await create_topics(self.bootstrap, self.topics)
        self._consumer = AIOKafkaConsumer(
            *self.topics,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            metadata_max_age_ms=1000,
        )
        await self._consumer.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def poll(self) -> list[Delivered]:
        assert self._consumer is not None
        batches = await self._consumer.getmany(timeout_ms=100)
        fresh = [
            Delivered(
                topic=m.topic,
                partition=m.partition,
                offset=m.offset,
                key=(m.key or b"").decode(),
                value=m.value or b"",
                headers={k: v.decode() for k, v in m.headers},
            )
            for records in batches.values()
            for m in records
        ]
        self.messages.extend(fresh)
        return fresh

    async def read_until(
        self, done: Callable[[list[Delivered]], bool], timeout_s: float = 60.0
    ) -> list[Delivered]:
        async with asyncio.timeout(timeout_s):
            while not done(self.messages):
                await self.poll()
        return self.messages

    async def read_to_end(self, timeout_s: float = 30.0) -> list[Delivered]:
        """Reads every partition of the topics up to the end offset the broker reports now.

        Whatever was written and acknowledged before the call is in ``messages`` on return,
        and nothing is waited for beyond it: once the producers under test have stopped,
        "nothing more arrived" is a statement about the broker's log, not about a pause."""
        assert self._consumer is not None
        async with asyncio.timeout(timeout_s):
            ends = await self._consumer.end_offsets(list(await self._every_partition()))
            for partition, end in ends.items():
                while await self._consumer.position(partition) < end:
                    await self.poll()
        return self.messages

    async def _every_partition(self) -> set[TopicPartition]:
        """Every partition of the topics, once the subscription has them all assigned."""
        assert self._consumer is not None
        while True:
            partitions = {
                TopicPartition(topic, partition)
                for topic in self.topics
                for partition in self._consumer.partitions_for_topic(topic) or ()
            }
            known = all(self._consumer.partitions_for_topic(topic) for topic in self.topics)
            if known and partitions <= self._consumer.assignment():
                return partitions
            await self.poll()  # the consumer refreshes its metadata and assignment meanwhile

    async def read_event_ids(
        self, wanted: Iterable[uuid.UUID], timeout_s: float = 60.0
    ) -> list[Delivered]:
        needed = set(wanted)
        return await self.read_until(
            lambda seen: needed <= {m.event_id for m in seen}, timeout_s=timeout_s
        )


# --- the relay, as integration tests run it ------------------------------------------------


def relay_settings(base: RuntimeSettings, **overrides: object) -> RelaySettings:
    """Relay settings for a test: its database, Kafka and topic prefix; quick timers."""
    values: dict[str, object] = {
        "database_url": base.database_url,
        "kafka_bootstrap_servers": base.kafka_bootstrap_servers,
        "kafka_topic_prefix": base.kafka_topic_prefix,
        "relay_partitions": 4,
        "relay_lease_seconds": 3.0,
        "relay_poll_interval_seconds": 0.5,
        "relay_backoff_initial_seconds": 0.05,
        "relay_backoff_max_seconds": 0.5,
        "relay_send_timeout_seconds": 2.0,
        "relay_metrics_interval_seconds": 0.2,
        "relay_topic_partitions": 3,
        "relay_topic_tiers": ["standard"],
        "db_pool_max_size": 4,
    }
    values.update(overrides)
    return RelaySettings.model_validate(values)


def relay_topics(settings: RelaySettings, tiers: Iterable[str] = ("standard",)) -> list[str]:
    prefix = settings.kafka_topic_prefix
    return [document_events_topic(prefix)] + [index_hints_topic(tier, prefix) for tier in tiers]


@contextlib.asynccontextmanager
async def running_relay(
    settings: RelaySettings, *, owner: str | None = None, after_ack: AfterAck | None = None
) -> AsyncIterator[Relay]:
    pool = await create_relay_pool(settings)
    relay = Relay(
        settings,
        leases=PgLeaseStore(pool),
        source=PgOutboxSource(pool),
        sink=KafkaSink(settings),
        wakeups=PgWakeups(settings),
        owner=owner,
        after_ack=after_ack,
    )
    try:
        async with relay:
            yield relay
    finally:
        await pool.close()


async def wait_for_partitions(relay: Relay, count: int, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        await relay.wait_for_partitions(count)


async def publish(
    conn: asyncpg.Connection[Any],
    *,
    tenant_id: str = "acme",
    document: str | None = None,
    event_type: str = "DocumentPublished",
    tier: str = "standard",
    payload: bytes | None = None,
) -> StoredEvent:
    """One outbox event in a transaction of its own (committed on return)."""
    document = document or str(uuid.uuid4())
    async with conn.transaction():
        return await add_event(
            conn,
            OutboxEvent(
                event_type=event_type,
                tenant_id=tenant_id,
                tier=tier,
                aggregate_key=aggregate_key(tenant_id, document),
                payload=payload if payload is not None else os.urandom(16),
            ),
        )
