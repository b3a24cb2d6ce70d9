"""The aiokafka side of `kb ingest`: the tier's consumer group, the dead-letter producer.

Never skip (the relay's rule, services/relay/outbox_pg.py, the other way round): an offset
is committed only after its record is done -- its transaction committed, or its dead letter
acknowledged by the broker -- and only up to the first record not done. A transient failure
retries the same record with backoff; a crash anywhere redelivers from the last commit, and
a command applied before answers from its record (services/publisher/ingest/apply.py).
The partitions of one batch are handled side by side, each in its offset order: a
document's commands share a partition (the producer keys them by tenant and document), so
they apply in the order sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    CommitFailedError,
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
)

from services.publisher.ingest.commands import EraseDocument
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.ports import IngestRecord
from services.publisher.ingest.process import Handled, Refusal, Verified
from services.publisher.ingest.settings import IngestSettings
from services.runtime.backoff import Backoff
from services.runtime.errors import KafkaUnavailable, KbError
from services.runtime.logging import get_logger
from services.runtime.messaging.events import ingest_dead_topic
from services.runtime.messaging.kafka import kafka_client_kwargs
from services.runtime.signals import ignoring_foreign_cancellation

log = get_logger(__name__)

PROBLEM_CODE_HEADER = "kb-problem-code"
PROBLEM_DETAIL_HEADER = "kb-problem-detail"
SOURCE_HEADER = "kb-source"  # topic/partition/offset the dead letter was read at
DEAD_LETTER_HEADERS = frozenset({PROBLEM_CODE_HEADER, PROBLEM_DETAIL_HEADER, SOURCE_HEADER})
MAX_DETAIL_CHARS = 1000

T = TypeVar("T")


def to_record(message: Any) -> IngestRecord:
    headers = {k: v for k, v in (message.headers or ()) if isinstance(v, bytes)}
    sent_at = None
    if message.timestamp is not None and message.timestamp >= 0:
        sent_at = datetime.fromtimestamp(message.timestamp / 1000, UTC)
    return IngestRecord(
        message.topic,
        message.partition,
        message.offset,
        message.key,
        message.value,
        headers,
        sent_at,
    )


async def start_when_reachable(
    start: Callable[[], Awaitable[None]], stop: asyncio.Event, backoff: Backoff, *, client: str
) -> bool:
    """Start a Kafka client, again after a backoff while the broker is unreachable: a
    process started during an outage waits for the broker, as the relay does, instead of
    exiting. False when stopped first."""
    failures = 0
    while not stop.is_set():
        try:
            await start()
            return True
        except KafkaConnectionError as error:
            failures += 1
            log.warning(
                "ingest.kafka_unreachable", client=client, failures=failures, error=str(error)
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.delay(failures))
    return False


async def create_topics(settings: IngestSettings, names: Iterable[str]) -> None:
    """Create ``names`` unless they exist; a broker that forbids it is logged, not fatal
    (the topics are then the operator's to create)."""
    admin = AIOKafkaAdminClient(**kafka_client_kwargs(settings))
    try:
        await admin.start()
        for name in names:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [NewTopic(name, settings.ingest_topic_partitions, replication_factor=1)]
                )
    except KafkaError as error:
        log.warning("ingest.topics_not_created", error=type(error).__name__)
    finally:
        await admin.close()


class KafkaDeadLetters:
    """The tier's dead-letter topic: the record's key, value and headers as read, plus the
    problem and where it was read, so `kb ingest replay-dead` can apply it again."""

    def __init__(self, settings: IngestSettings, tier: str) -> None:
        self._topic = ingest_dead_topic(tier, settings.kafka_topic_prefix)
        self._producer = AIOKafkaProducer(
            acks="all", enable_idempotence=True, **kafka_client_kwargs(settings)
        )

    async def start(self) -> None:
        await self._producer.start()

    async def close(self) -> None:
        await ignoring_foreign_cancellation(self._producer.stop())

    async def send(self, record: IngestRecord, code: str, detail: str) -> None:
        headers = [(k, v) for k, v in record.headers.items() if k not in DEAD_LETTER_HEADERS]
        headers += [
            (PROBLEM_CODE_HEADER, code.encode()),
            (PROBLEM_DETAIL_HEADER, detail[:MAX_DETAIL_CHARS].encode("utf-8", "replace")),
            (SOURCE_HEADER, record.source.encode()),
        ]
        try:
            await self._producer.send_and_wait(
                self._topic, record.value, key=record.key, headers=headers
            )
        except KafkaError as error:
            raise KafkaUnavailable(f"the dead letter was not acknowledged: {error!r}") from error


class Processing(Protocol):
    """What the loop asks of services/publisher/ingest/process.py."""

    async def sort(
        self, records: Sequence[IngestRecord]
    ) -> tuple[list[Verified], list[Refusal]]: ...

    async def apply(self, run: Sequence[Verified]) -> list[Handled]: ...

    async def dead_letter(self, refusal: Refusal) -> None: ...


UNVERIFIED = "-"  # the backlog's tenant label of records not (yet) verified


@dataclass
class IngestLoop:
    """Reads a batch and hands each partition's records, verified, to ``processor`` a
    tenant's run at a time: the tenants of a partition side by side (one flooding does not
    hold the others' commands behind its own), each tenant's in offset order, the
    partitions side by side. Commits, per partition, the prefix of records done."""

    consumer: AIOKafkaConsumer
    processor: Processing
    tier: str
    metrics: IngestMetrics
    backoff: Backoff
    batch_size: int
    poll_timeout_seconds: float
    # KB_INGEST_APPLY_BATCH: most commands applied in one transaction.
    apply_batch: int = 100
    # Tests: awaited with the count of records done so far, before a batch's commit.
    before_commit: Callable[[int], Awaitable[None]] | None = None

    async def run(
        self, stop: asyncio.Event, *, until_end: dict[TopicPartition, int] | None = None
    ) -> int:
        """Until ``stop`` (or, given ``until_end``, until every partition reached its
        offset there); the number of records done."""
        done = 0
        while not stop.is_set():
            if until_end is not None and await self._reached(until_end):
                break
            batches = await self.consumer.getmany(
                timeout_ms=int(self.poll_timeout_seconds * 1000), max_records=self.batch_size
            )
            if until_end is not None:
                batches = {
                    tp: [m for m in records if m.offset < until_end.get(tp, 0)]
                    for tp, records in batches.items()
                }
            ends = await asyncio.gather(
                *(self._drain(tp, records, stop) for tp, records in batches.items() if records)
            )
            offsets = {tp: end for tp, end, _ in ends if end is not None}
            done += sum(count for _, _, count in ends)
            if self.before_commit is not None and offsets:
                await self.before_commit(done)
            await self._commit(offsets)
            await self._measure_lag()
        return done

    async def _drain(
        self, tp: TopicPartition, messages: list[Any], stop: asyncio.Event
    ) -> tuple[TopicPartition, int | None, int]:
        """The offset to commit for ``tp`` (None: none done) and how many were done."""
        records = [to_record(message) for message in messages]
        done: set[int] = set()
        sorted_ = await self._until_done(lambda: self.processor.sort(records), records[0], stop)
        if sorted_:
            verified, refused = sorted_[0]
            lanes = tenant_runs(verified, self.apply_batch)
            await asyncio.gather(
                self._refuse(refused, done, stop),
                *(self._lane(tenant, runs, done, stop) for tenant, runs in lanes.items()),
            )
        next_offset: int | None = None
        for record in records:
            if record.offset not in done:
                # Stopped while it kept failing: it and the rest of the batch are read
                # again (from the commit) by whoever runs the partition next.
                self.consumer.seek(tp, record.offset)
                break
            next_offset = record.offset + 1
        return tp, next_offset, len(done)

    async def _lane(
        self, tenant: str, runs: list[list[Verified]], done: set[int], stop: asyncio.Event
    ) -> None:
        backlog = self.metrics.backlog.labels(self.tier, tenant)
        left = sum(len(run) for run in runs)
        backlog.inc(left)
        try:
            for run in runs:
                step = functools.partial(self.processor.apply, run)
                if not await self._until_done(step, run[0].record, stop):
                    return
                done.update(item.record.offset for item in run)
                backlog.dec(len(run))
                left -= len(run)
        finally:
            backlog.dec(left)  # stopped: no longer held here

    async def _refuse(self, refused: list[Refusal], done: set[int], stop: asyncio.Event) -> None:
        backlog = self.metrics.backlog.labels(self.tier, UNVERIFIED)
        backlog.inc(len(refused))
        try:
            for refusal in refused:
                step = functools.partial(self.processor.dead_letter, refusal)
                if not await self._until_done(step, refusal.record, stop):
                    return
                done.add(refusal.record.offset)
        finally:
            backlog.dec(len(refused))

    async def _until_done(
        self, step: Callable[[], Awaitable[T]], record: IngestRecord, stop: asyncio.Event
    ) -> list[T]:
        """``[what step answered]`` once it succeeds; [] when stopped while it kept failing."""
        failures = 0
        while True:
            try:
                return [await step()]
            except KbError as error:
                if not error.retriable:
                    raise
                failures += 1
                fields = record.log_fields(tier=self.tier, code=error.code, failures=failures)
                log.warning("ingest.retrying", **fields)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.backoff.delay(failures))
            if stop.is_set():
                return []

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except CommitFailedError as error:
            # The group moved the partitions elsewhere meanwhile: the new owner reads them
            # again from the last commit, and finds the commands applied (their records).
            log.warning("ingest.commit_failed", tier=self.tier, error=str(error))

    async def _reached(self, until_end: dict[TopicPartition, int]) -> bool:
        for tp, end in until_end.items():
            if tp in self.consumer.assignment() and await self.consumer.position(tp) < end:
                return False
        return True

    async def _measure_lag(self) -> None:
        lag = 0
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                lag += max(0, high - await self.consumer.position(tp))
        self.metrics.lag.labels(self.tier).set(lag)


def tenant_runs(verified: list[Verified], size: int) -> dict[str, list[list[Verified]]]:
    """Each tenant's records in their order, cut in runs of at most ``size`` (an erase
    alone: it runs in transactions of its own)."""
    lanes: dict[str, list[list[Verified]]] = {}
    for item in verified:
        runs = lanes.setdefault(item.command.tenant_id, [])
        erase = isinstance(item.command, EraseDocument)
        if (
            erase
            or not runs
            or len(runs[-1]) >= size
            or isinstance(runs[-1][0].command, EraseDocument)
        ):
            runs.append([item])
        else:
            runs[-1].append(item)
    return lanes
