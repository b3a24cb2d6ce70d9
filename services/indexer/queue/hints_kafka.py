"""The aiokafka side of the index hints: one consumer in the tier's consumer group.

aiokafka reconnects by itself and simply returns no records while the broker is away, so
an outage would go unnoticed; a cheap metadata probe after a quiet spell tells "no hints"
from "no Kafka", and a failed probe hands the outage to ``HintConsumer`` (which logs it,
clears the ``connected`` gauge and reconnects with backoff).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from services.indexer.queue.hints import HintMessage
from services.runtime.errors import KafkaUnavailable
from services.runtime.logging import get_logger
from services.runtime.messaging.events import index_hints_topic, indexer_consumer_group
from services.runtime.messaging.kafka import kafka_client_kwargs
from services.runtime.settings import RuntimeSettings
from services.runtime.signals import ignoring_foreign_cancellation

log = get_logger(__name__)


class KafkaHintSource:
    def __init__(self, consumer: AIOKafkaConsumer, *, probe_after_seconds: float) -> None:
        self._consumer = consumer
        self._probe_after = probe_after_seconds
        self._quiet_since = time.monotonic()

    @classmethod
    async def connect(
        cls,
        settings: RuntimeSettings,
        tier: str,
        *,
        probe_after_seconds: float = 5.0,
        request_timeout_seconds: float = 5.0,
        join_timeout_seconds: float = 30.0,
    ) -> KafkaHintSource:
        prefix = settings.kafka_topic_prefix
        consumer = AIOKafkaConsumer(
            # The group carries the topic prefix too: test runs and side-by-side
            # deployments on one cluster must not share a tier's group.
            group_id=prefix + indexer_consumer_group(tier),
            enable_auto_commit=False,
            # A new group starts at the end: older hints are for work the first claim
            # (and the poll timer) finds anyway.
            auto_offset_reset="latest",
            request_timeout_ms=int(request_timeout_seconds * 1000),
            metadata_max_age_ms=30_000,
            max_partition_fetch_bytes=1024 * 1024,
            **kafka_client_kwargs(settings),
        )
        assigned = _Assigned()
        try:
            await consumer.start()
            consumer.subscribe([index_hints_topic(tier, prefix)], listener=assigned)
        except BaseException:
            await _stop(consumer)
            raise
        source = cls(consumer, probe_after_seconds=probe_after_seconds)
        # Joined once the group assigned partitions and their start positions are fixed:
        # hints sent from then on are read. Bounded: a slow join only costs latency.
        try:
            async with asyncio.timeout(join_timeout_seconds):
                await assigned.event.wait()
                await source.joined()
        except TimeoutError:
            log.warning("hints.join_slow", tier=tier, waited_seconds=join_timeout_seconds)
        except BaseException:
            await _stop(consumer)
            raise
        return source

    async def read(self, timeout_seconds: float) -> list[HintMessage]:
        batches = await self._consumer.getmany(
            timeout_ms=int(timeout_seconds * 1000), max_records=1000
        )
        messages = [
            HintMessage(value=record.value, headers=_headers(record.headers))
            for records in batches.values()
            for record in records
        ]
        now = time.monotonic()
        if messages:
            self._quiet_since = now
        elif now - self._quiet_since >= self._probe_after:
            self._quiet_since = now
            await self._probe()
        return messages

    async def joined(self) -> bool:
        """Whether the group gave us partitions and their start positions are fixed: hints
        sent from then on are read."""
        assigned = self._consumer.assignment()
        for partition in assigned:
            await self._consumer.position(partition)
        return bool(assigned)

    async def commit(self) -> None:
        await self._consumer.commit()

    async def close(self) -> None:
        await _stop(self._consumer)

    async def _probe(self) -> None:
        """Raise ``KafkaUnavailable`` when no broker answers a metadata request in time."""
        client: Any = self._consumer._client  # aiokafka has no public liveness call
        try:
            ok = await asyncio.wait_for(client.fetch_all_metadata(), self._probe_after)
        except Exception as error:
            raise KafkaUnavailable(f"no Kafka broker answers: {error!r}") from error
        if ok is None:
            raise KafkaUnavailable("no Kafka broker answers a metadata request")


class _Assigned(ConsumerRebalanceListener):  # type: ignore[misc]
    """Sets ``event`` when the group assigns this consumer its first partitions."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        return None

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            self.event.set()


async def _stop(consumer: AIOKafkaConsumer) -> None:
    """Stop the consumer. With the broker gone, aiokafka's stop() can re-raise the
    cancellation of its own fetch task; that is not a cancellation of ours, and letting it
    out would end the hint consumer (and with it the indexer) on a mere Kafka outage."""
    await ignoring_foreign_cancellation(consumer.stop())


def _headers(headers: Any) -> dict[str, bytes]:
    return {key: value for key, value in (headers or ()) if isinstance(value, bytes)}
