"""The Kafka side of the relay: one idempotent producer (acks=all), topic routing,
headers, topic creation, and a small state machine that rebuilds the producer after
failures instead of crashing.

Order: records of one batch are appended to the producer in position order before any
is awaited; the idempotent producer keeps per-partition order across its retries, and one
key always maps to one partition. A failed batch is sent again whole (duplicates are
allowed, consumers deduplicate on event_id; nothing is lost).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from services.relay import metrics
from services.relay.ports import OutboxRecord
from services.relay.settings import DOCUMENT_EVENTS_TOPIC, INDEX_HINTS_TOPIC, RelaySettings
from services.runtime.errors import KafkaUnavailable
from services.runtime.logging import get_logger

log = get_logger(__name__)

# Kafka error codes a create-topics answer may carry that mean "fine, carry on".
_TOPIC_ALREADY_EXISTS = 36
# Not allowed to create (authorization, policy): rely on the topic existing.
_NOT_ALLOWED = {29, 31, 44}  # topic/cluster authorization failed, policy violation


def headers_for(record: OutboxRecord, *, replay: bool) -> list[tuple[str, bytes]]:
    return [
        ("event_type", record.event_type.encode()),
        ("event_id", str(record.event_id).encode()),
        ("tenant_id", record.tenant_id.encode()),
        ("outbox_position", str(record.position).encode()),
        ("replay", b"true" if replay else b"false"),
    ]


class SinkState(enum.Enum):
    STOPPED = "stopped"
    DISCONNECTED = "disconnected"  # no producer: the next send builds one
    READY = "ready"
    CLOSED = "closed"


class KafkaSink:
    def __init__(self, settings: RelaySettings, *, client_id: str = "kb-relay") -> None:
        self._settings = settings
        self._client_id = client_id
        self._producer: AIOKafkaProducer | None = None
        self._ensured_topics: set[str] = set()
        self._lock = asyncio.Lock()
        self.state = SinkState.STOPPED

    async def start(self, tiers: Iterable[str] = ()) -> None:
        """Get ready to send; a broker that is down now is not an error (sends retry)."""
        self.state = SinkState.DISCONNECTED
        topics = {self._settings.topic(DOCUMENT_EVENTS_TOPIC)}
        topics |= {self._settings.topic(INDEX_HINTS_TOPIC + tier) for tier in tiers}
        try:
            await self._ensure_topics(topics)
            await self._ready_producer()
        except KafkaUnavailable as error:
            log.warning("relay.kafka_unavailable", error=str(error))

    async def send(self, records: Sequence[OutboxRecord], *, replay: bool) -> None:
        if self.state is SinkState.CLOSED:
            raise KafkaUnavailable("the Kafka sink is closed")
        if not records:
            return
        label = "true" if replay else "false"
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._settings.relay_send_timeout_s):
                await self._ensure_topics(
                    {self._settings.topic_for(r.event_type, r.tier) for r in records}
                )
                producer = await self._ready_producer()
                futures: list[asyncio.Future[Any]] = []
                try:
                    for record in records:
                        futures.append(
                            await producer.send(
                                self._settings.topic_for(record.event_type, record.tier),
                                value=record.payload,
                                key=record.aggregate_key.encode(),
                                headers=headers_for(record, replay=replay),
                            )
                        )
                    results = await asyncio.gather(*futures, return_exceptions=True)
                except BaseException:
                    _abandon(futures)
                    raise
                failures = [r for r in results if isinstance(r, BaseException)]
                if failures:
                    raise failures[0]
        except (KafkaError, OSError, TimeoutError) as error:
            metrics.SEND_FAILURES.labels(code=type(error).__name__).inc()
            await self._reset()
            raise KafkaUnavailable(f"Kafka did not acknowledge the batch: {error!r}") from error
        metrics.SEND_LATENCY.labels(replay=label).observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.labels(replay=label).observe(len(records))
        metrics.EVENTS_SENT.labels(replay=label).inc(len(records))

    async def stop(self) -> None:
        self.state = SinkState.CLOSED
        await self._reset()

    # --- state machine --------------------------------------------------------------------

    async def _ready_producer(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is not None:
                return self._producer
            producer = AIOKafkaProducer(
                bootstrap_servers=self._settings.kafka_bootstrap_servers,
                client_id=self._client_id,
                acks="all",
                enable_idempotence=True,
                linger_ms=0,
                request_timeout_ms=max(1000, int(self._settings.relay_send_timeout_s * 1000)),
                retry_backoff_ms=100,
            )
            try:
                await producer.start()
            except (KafkaError, OSError) as error:
                await _quietly_stop(producer)
                raise KafkaUnavailable(f"cannot connect to Kafka: {error!r}") from error
            self._producer = producer
            self.state = SinkState.READY
            log.info("relay.kafka_connected")
            return producer

    async def _reset(self) -> None:
        async with self._lock:
            producer, self._producer = self._producer, None
            if self.state is SinkState.READY:
                self.state = SinkState.DISCONNECTED
        if producer is not None:
            await _quietly_stop(producer)

    async def _ensure_topics(self, topics: set[str]) -> None:
        missing = topics - self._ensured_topics
        if not missing:
            return
        if not self._settings.relay_create_topics:
            self._ensured_topics |= missing
            return
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self._settings.kafka_bootstrap_servers,
            client_id=f"{self._client_id}-admin",
            request_timeout_ms=10_000,
        )
        try:
            await admin.start()
            response = await admin.create_topics(
                [
                    NewTopic(
                        topic,
                        num_partitions=self._settings.relay_topic_partitions,
                        replication_factor=self._settings.relay_topic_replication_factor,
                    )
                    for topic in sorted(missing)
                ]
            )
        except (KafkaError, OSError, TimeoutError) as error:
            raise KafkaUnavailable(f"cannot create topics {sorted(missing)}: {error!r}") from error
        finally:
            await _quietly_close_admin(admin)
        for topic_error in response.topic_errors:
            topic, code = topic_error[0], topic_error[1]
            if code in (0, _TOPIC_ALREADY_EXISTS):
                self._ensured_topics.add(topic)
            elif code in _NOT_ALLOWED:
                log.warning("relay.topic_create_not_allowed", topic=topic, error_code=code)
                self._ensured_topics.add(topic)
            else:
                raise KafkaUnavailable(f"creating topic {topic} failed with Kafka error {code}")
            if code == 0:
                log.info("relay.topic_created", topic=topic)


def _abandon(futures: list[asyncio.Future[Any]]) -> None:
    """Nothing will await these any more: cancel the pending ones and read the failed ones,
    so none is reported as an exception never retrieved."""
    for future in futures:
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()


async def _quietly_stop(producer: AIOKafkaProducer) -> None:
    try:
        async with asyncio.timeout(10):
            await producer.stop()
    except Exception as error:
        log.warning("relay.producer_stop_failed", error=repr(error))


async def _quietly_close_admin(admin: AIOKafkaAdminClient) -> None:
    try:
        await admin.close()
    except Exception as error:
        log.warning("relay.admin_close_failed", error=repr(error))
