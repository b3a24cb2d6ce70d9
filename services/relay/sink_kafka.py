"""The Kafka side of the relay: one idempotent producer (acks=all), topic routing,
headers, topic creation, and a small state machine that rebuilds the producer after
failures instead of crashing.

Order: records of one batch are appended to the producer in position order before any
is awaited; the idempotent producer keeps per-partition order across its retries, and one
key always maps to one partition. A failed batch is sent again whole (duplicates are
allowed, consumers deduplicate on event_id; nothing is lost).

A send never outlives ``relay_send_timeout_seconds``, its failure included: the relay only
starts one that fits in its trusted lease time, and a copy of an old batch must not
reach Kafka after another relay took the partition over. So a producer that failed (or
whose send was given up) is never flushed: it stops sending at once (its queued batches
are failed and its sender task cancelled, synchronously), and its close gets a short
bounded part of the send's budget; whatever of it is left runs in the background,
sending nothing. Only the producer that failed is retired: a failure reported for an
older producer leaves the current one, and the other partitions' sends on it, alone.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError

from services.relay import metrics
from services.relay.ports import OutboxRecord
from services.relay.send_spans import SendSpans
from services.relay.settings import RelaySettings
from services.runtime.errors import KafkaUnavailable
from services.runtime.logging import get_logger
from services.runtime.messaging.events import (
    DOCUMENT_SEARCH_VERSION_SWITCHED,
    document_events_topic,
    index_hints_topic,
    topic_for,
)
from services.runtime.messaging.kafka import kafka_client_kwargs
from services.runtime.tracing.propagation import TRACEPARENT

log = get_logger(__name__)

# Kafka error codes a create-topics answer may carry that mean "fine, carry on".
_TOPIC_ALREADY_EXISTS = 36
# Not allowed to create (authorization, policy): rely on the topic existing.
_NOT_ALLOWED = {29, 31, 44}  # topic/cluster authorization failed, policy violation


def headers_for(
    record: OutboxRecord, *, replay: bool, traceparent: str | None = None
) -> list[tuple[str, bytes]]:
    headers = [
        ("event_type", record.event_type.encode()),
        ("event_id", str(record.event_id).encode()),
        ("tenant_id", record.tenant_id.encode()),
        ("outbox_position", str(record.position).encode()),
        ("replay", b"true" if replay else b"false"),
    ]
    # The switch's read-your-switch token (docs/scaling.md#read-your-switch): a header, not
    # a field of the Avro payload, because the switch's transaction writes the payload and
    # cannot know the WAL position of its own commit; the relay reads one after it.
    if record.search_token is not None and record.event_type == DOCUMENT_SEARCH_VERSION_SWITCHED:
        headers.append(("search_token", record.search_token.encode()))
    # The send's span (or, when the relay does not trace, the writer's): the consumer
    # continues the document's trace from it (docs/operations.md#tracing).
    if traceparent is not None:
        headers.append((TRACEPARENT, traceparent.encode()))
    return headers


def new_topic(name: str, partitions: int, replication_factor: int | None) -> NewTopic:
    """A topic to create; ``replication_factor`` None asks for the broker's
    ``default.replication.factor`` (-1 in CreateTopics, KIP-464). aiokafka's NewTopic
    refuses -1 without a replica assignment, so it is set after construction."""
    topic = NewTopic(name, num_partitions=partitions, replication_factor=replication_factor or 1)
    if replication_factor is None:
        topic.replication_factor = -1
    return topic


class SinkState(enum.Enum):
    STOPPED = "stopped"
    DISCONNECTED = "disconnected"  # no producer: the next send builds one
    READY = "ready"
    CLOSED = "closed"


def producer_close_budget(send_timeout_s: float) -> float:
    """The part of a send's budget kept for closing a failed producer."""
    return min(1.0, send_timeout_s / 4)


class _Generation:
    """One producer and, once retired, the task closing it."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.closing: asyncio.Task[None] | None = None


class KafkaSink:
    def __init__(
        self,
        settings: RelaySettings,
        *,
        client_id: str = "kb-relay",
        producer_factory: Callable[..., AIOKafkaProducer] = AIOKafkaProducer,
        admin_factory: Callable[..., AIOKafkaAdminClient] = AIOKafkaAdminClient,
    ) -> None:
        self._settings = settings
        self._client_id = client_id
        self._producer_factory = producer_factory
        self._admin_factory = admin_factory
        self._current: _Generation | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._ensured_topics: set[str] = set()
        self._lock = asyncio.Lock()
        self.state = SinkState.STOPPED
        self._close_s = producer_close_budget(settings.relay_send_timeout_seconds)

    async def start(self, tiers: Iterable[str] = ()) -> None:
        """Get ready to send; a broker that is down now is not an error (sends retry)."""
        self.state = SinkState.DISCONNECTED
        prefix = self._settings.kafka_topic_prefix
        topics = {document_events_topic(prefix)}
        topics |= {index_hints_topic(tier, prefix) for tier in tiers}
        try:
            await self._ensure_topics(topics)
            await self._ready_generation()
        except KafkaUnavailable as error:
            log.warning("relay.kafka_unavailable", error=str(error))

    async def send(self, records: Sequence[OutboxRecord], *, replay: bool) -> None:
        if self.state is SinkState.CLOSED:
            raise KafkaUnavailable("the Kafka sink is closed")
        if not records:
            return
        label = "true" if replay else "false"
        prefix = self._settings.kafka_topic_prefix
        topics = [topic_for(r.event_type, r.tier, prefix) for r in records]
        started = time.perf_counter()
        generation: _Generation | None = None
        try:
            # What is left of relay_send_timeout_seconds after this is for closing a failed
            # producer: the whole send, failure included, stays within the timeout.
            async with asyncio.timeout(self._settings.relay_send_timeout_seconds - self._close_s):
                await self._ensure_topics(set(topics))
                generation = await self._ready_generation()
                producer = generation.producer
                futures: list[asyncio.Future[Any]] = []
                spans = SendSpans(replay=replay)
                try:
                    for record, topic in zip(records, topics, strict=True):
                        traceparent = spans.start(record, topic)
                        futures.append(
                            await producer.send(
                                topic,
                                value=record.payload,
                                key=record.aggregate_key.encode(),
                                headers=headers_for(record, replay=replay, traceparent=traceparent),
                            )
                        )
                    results = await asyncio.gather(*futures, return_exceptions=True)
                except BaseException as error:
                    _abandon(futures)
                    spans.fail(error)
                    raise
                spans.end(results)
                failures = [r for r in results if isinstance(r, BaseException)]
                if failures:
                    raise failures[0]
        except (KafkaError, OSError, TimeoutError) as error:
            metrics.SEND_FAILURES.labels(code=type(error).__name__).inc()
            if generation is not None:
                await self._retire(generation, wait_s=self._close_s)
            raise KafkaUnavailable(f"Kafka did not acknowledge the batch: {error!r}") from error
        except BaseException:
            # Given up (cancelled): what the producer still holds must not go out later.
            if generation is not None:
                self._retire_now(generation)
            raise
        metrics.SEND_LATENCY.labels(replay=label).observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.labels(replay=label).observe(len(records))
        metrics.EVENTS_SENT.labels(replay=label).inc(len(records))

    async def stop(self) -> None:
        self.state = SinkState.CLOSED
        if self._current is not None:
            self._retire_now(self._current)
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=self._close_s)

    # --- state machine --------------------------------------------------------------------

    async def _ready_generation(self) -> _Generation:
        async with self._lock:
            if self._current is not None:
                return self._current
            producer = self._producer_factory(
                **kafka_client_kwargs(self._settings),
                client_id=self._client_id,
                acks="all",
                enable_idempotence=True,
                linger_ms=0,
                request_timeout_ms=max(1000, int(self._settings.relay_send_timeout_seconds * 1000)),
                retry_backoff_ms=100,
            )
            generation = _Generation(producer)
            try:
                await producer.start()
            except (KafkaError, OSError) as error:
                self._retire_now(generation)
                raise KafkaUnavailable(f"cannot connect to Kafka: {error!r}") from error
            except BaseException:
                self._retire_now(generation)
                raise
            self._current = generation
            if self.state is not SinkState.CLOSED:
                self.state = SinkState.READY
            log.info("relay.kafka_connected")
            return generation

    def _retire_now(self, generation: _Generation) -> asyncio.Task[None]:
        """Stop ``generation`` sending at once and close it in the background; only the
        current producer is replaced (a failure reported for an older one changes
        nothing). Idempotent."""
        if self._current is generation:
            self._current = None
            if self.state is SinkState.READY:
                self.state = SinkState.DISCONNECTED
        if generation.closing is None:
            _stop_sending(generation.producer)
            closing = asyncio.create_task(_quietly_stop(generation.producer))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            generation.closing = closing
        return generation.closing

    async def _retire(self, generation: _Generation, *, wait_s: float) -> None:
        """Retire ``generation`` and give its close up to ``wait_s``: it sends nothing any
        more either way."""
        closing = self._retire_now(generation)
        await asyncio.wait({closing}, timeout=wait_s)

    async def _ensure_topics(self, topics: set[str]) -> None:
        missing = topics - self._ensured_topics
        if not missing:
            return
        if not self._settings.relay_create_topics:
            self._ensured_topics |= missing
            return
        admin = self._admin_factory(
            **kafka_client_kwargs(self._settings),
            client_id=f"{self._client_id}-admin",
            request_timeout_ms=10_000,
        )
        try:
            await admin.start()
            response = await admin.create_topics(
                [
                    new_topic(
                        topic,
                        self._settings.relay_topic_partitions,
                        self._settings.relay_topic_replication_factor,
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


def _stop_sending(producer: AIOKafkaProducer) -> None:
    """Make ``producer`` send nothing more, synchronously: fail every batch it still
    queues (their futures fail at once, so nothing waits for a flush) and cancel its
    sender task. aiokafka has no close-without-flush (Java's ``close(Duration.ZERO)``), so
    this reaches into its accumulator and sender; a producer without them (a test double)
    is left to its ``stop``. Bytes already handed to a socket may still arrive."""
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        accumulator.fail_all(KafkaConnectionError("the relay abandoned this producer"))
    sender = getattr(producer, "_sender", None)
    task = getattr(sender, "sender_task", None)
    if task is not None and not task.done():
        task.cancel()


async def _quietly_stop(producer: AIOKafkaProducer) -> None:
    """Close a producer that already stopped sending (nothing left to flush)."""
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
