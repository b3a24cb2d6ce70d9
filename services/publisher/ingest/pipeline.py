"""The ingest loop: reads ahead, applies each partition's tenants side by side, commits each
partition's prefix of records done (docs/architecture.md#publish-by-event).

Never skip: an offset is committed only once every record before it is done -- its
transaction committed, or its dead letter acknowledged -- so a crash anywhere redelivers
from the last commit, and a command applied before answers from its record. A record
that fails transiently is retried, never passed.

Fairness: the records of a partition are sorted into lanes, one per tenant, each applied
in offset order (a document's commands share a partition and a tenant: they apply in the
order sent) a run of at most ``apply_batch`` at a time, the lanes side by side. The loop
keeps reading while lanes work, up to ``read_ahead`` records not yet done, so a tenant's
commands behind another tenant's flood (or a stuck command) on the same partition apply
without waiting for it; only their offsets wait, for the prefix.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError

from services.publisher.ingest.commands import EraseDocument
from services.publisher.ingest.consumer_kafka import to_record
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.ports import Backlog, BacklogReports, IngestRecord
from services.publisher.ingest.process import Handled, Refusal, Verified
from services.publisher.ingest.settings import IngestSettings
from services.runtime.backoff import Backoff
from services.runtime.errors import KbError
from services.runtime.logging import get_logger
from services.runtime.settings import section_of

log = get_logger(__name__)

T = TypeVar("T")
UNVERIFIED = "-"  # the backlog's tenant label of records not verified


class Processing(Protocol):
    """What the loop asks of services/publisher/ingest/process.py."""

    async def sort(
        self, records: Sequence[IngestRecord]
    ) -> tuple[list[Verified], list[Refusal]]: ...

    async def apply(self, run: Sequence[Verified]) -> list[Handled]: ...

    async def dead_letter(self, refusal: Refusal) -> None: ...


@dataclass
class Window:
    """A partition's records fetched and not yet committed, in offset order."""

    offsets: collections.deque[int] = field(default_factory=collections.deque)
    done: set[int] = field(default_factory=set)

    def prefix(self) -> int | None:
        """The offset to commit once the records done at the front are dropped (None: the
        front is not done)."""
        end = None
        while self.offsets and self.offsets[0] in self.done:
            end = self.offsets.popleft() + 1
            self.done.discard(end - 1)
        return end


@dataclass(frozen=True)
class IngestPace:
    """How much the loop reads and applies at once, and how often it reports: its
    ``KB_INGEST_*`` settings of these names (``report_seconds``:
    KB_INGEST_BACKLOG_REPORT_SECONDS)."""

    batch_size: int
    poll_timeout_seconds: float
    # Most commands applied in one transaction.
    apply_batch: int = 500
    # Most records fetched and not yet done.
    read_ahead: int = 1000
    # How often the backlog per tenant goes to the operator page.
    report_seconds: float = 5.0


def pace_of(settings: IngestSettings) -> IngestPace:
    return section_of(
        IngestPace, settings, "ingest_", report_seconds=settings.ingest_backlog_report_seconds
    )


@dataclass
class IngestLoop:
    consumer: AIOKafkaConsumer
    processor: Processing
    tier: str
    metrics: IngestMetrics
    backoff: Backoff
    pace: IngestPace
    # Tests: awaited, every lane idle, with the count of records done so far, before a
    # commit.
    before_commit: Callable[[int], Awaitable[None]] | None = None
    _windows: dict[TopicPartition, Window] = field(default_factory=dict)
    _lanes: dict[tuple[TopicPartition, str], asyncio.Task[None]] = field(default_factory=dict)
    _queues: dict[tuple[TopicPartition, str], collections.deque[list[Any]]] = field(
        default_factory=dict
    )
    _retired: set[asyncio.Task[None]] = field(default_factory=set)
    _progress: asyncio.Event = field(default_factory=asyncio.Event)
    _done: int = 0
    # Where the backlog per tenant goes for the operator page, every ``report_seconds``.
    reports: BacklogReports | None = None
    consumer_id: uuid.UUID = field(default_factory=uuid.uuid4)
    _reported: float = float("-inf")

    async def run(
        self, stop: asyncio.Event, *, until_end: dict[TopicPartition, int] | None = None
    ) -> int:
        """Until ``stop`` (or, given ``until_end``, until every partition reached its
        offset there and every record read is done); the number of records done."""
        try:
            while not stop.is_set():
                if until_end is not None and not self._held() and await self._reached(until_end):
                    break
                if self._held() < self.pace.read_ahead:
                    await self._fetch(stop, until_end)
                else:
                    self._progress.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._progress.wait(), self.pace.poll_timeout_seconds
                        )
                self._tasks()
                await self._commit_prefixes()
                await self._measure_lag()
                await self._report()
        finally:
            # The lanes end their current step (a stopped retry gives up), then what is
            # done is committed; the rest is read again by the partition's next owner. Not
            # through _tasks(): after a lane's failure it would raise again, and the other
            # lanes would go on working while the caller closes the pool under them.
            await asyncio.gather(*self._lanes.values(), *self._retired, return_exceptions=True)
            await self._commit_prefixes()
            self._reported = float("-inf")
            await self._report()  # what is left is no longer held here
        return self._done

    def _tasks(self) -> list[asyncio.Task[None]]:
        """Every lane's task, those of windows read again included; a lane's failure (not a
        retriable one) is raised here: the process ends, its records read again."""
        self._retired = {task for task in self._retired if not task.done()}
        tasks = [*self._lanes.values(), *self._retired]
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return tasks

    async def _fetch(
        self, stop: asyncio.Event, until_end: dict[TopicPartition, int] | None
    ) -> None:
        batches = await self.consumer.getmany(
            timeout_ms=int(self.pace.poll_timeout_seconds * 1000),
            max_records=min(self.pace.batch_size, self.pace.read_ahead - self._held()),
        )
        for tp, messages in batches.items():
            if until_end is not None:
                messages = [m for m in messages if m.offset < until_end.get(tp, 0)]
            if messages:
                await self._dispatch(tp, [to_record(m) for m in messages], stop)

    async def _dispatch(
        self, tp: TopicPartition, records: list[IngestRecord], stop: asyncio.Event
    ) -> None:
        window = self._windows.get(tp)
        if window is None or (window.offsets and records[0].offset <= window.offsets[-1]):
            # New, or read again from its commit (the group gave it back): a new window;
            # lanes still working on the old one finish there (their commands answer as
            # applied when read again).
            self._forget(tp)
            window = self._windows[tp] = Window()
        window.offsets.extend(record.offset for record in records)
        sorted_ = await self._until_done(
            functools.partial(self.processor.sort, records), records[0], stop
        )
        if not sorted_:
            return  # stopped: nothing of these is done
        verified, refused = sorted_[0]
        for refusal in refused:
            self._enqueue(tp, UNVERIFIED, [refusal], window, stop)
        for tenant, runs in tenant_runs(verified, self.pace.apply_batch).items():
            for run in runs:
                self._enqueue(tp, tenant, run, window, stop)

    def _enqueue(
        self, tp: TopicPartition, tenant: str, run: list[Any], window: Window, stop: asyncio.Event
    ) -> None:
        self.metrics.held(self.tier, tenant, len(run))
        key = (tp, tenant)
        queue = self._queues.setdefault(key, collections.deque())
        queue.append(run)
        lane = self._lanes.get(key)
        if lane is None or lane.done():
            self._lanes[key] = asyncio.create_task(self._lane(key, queue, window, stop))

    async def _lane(
        self,
        key: tuple[TopicPartition, str],
        queue: collections.deque[list[Any]],
        window: Window,
        stop: asyncio.Event,
    ) -> None:
        await self._work(key[1], queue, window, stop)
        # Idle and empty: dropped, or the lanes would grow with the tenants ever seen until
        # a rebalance (the tenant's next record makes a new one). Not after a failure: the
        # task stays for _tasks() to raise it. Nothing awaits between the queue found empty
        # and this, so no record can have joined it meanwhile.
        if self._queues.get(key) is queue and not queue:
            del self._queues[key]
        if self._lanes.get(key) is asyncio.current_task():
            del self._lanes[key]

    async def _work(
        self,
        tenant: str,
        queue: collections.deque[list[Any]],
        window: Window,
        stop: asyncio.Event,
    ) -> None:
        def let_go(records: int) -> None:
            self.metrics.held(self.tier, tenant, -records)

        while queue:
            if stop.is_set():  # its current step is done: the rest is read again
                let_go(sum(len(r) for r in queue))
                queue.clear()
                return
            if tenant != UNVERIFIED:
                coalesce(queue, self.pace.apply_batch)
            run = queue[0]
            step: Callable[[], Awaitable[object]]
            if tenant == UNVERIFIED:
                step = functools.partial(self.processor.dead_letter, run[0])
            else:
                step = functools.partial(self.processor.apply, run)
            if not await self._until_done(step, run[0].record, stop):
                let_go(sum(len(r) for r in queue))  # stopped: no longer held here
                queue.clear()
                return
            queue.popleft()
            window.done.update(item.record.offset for item in run)
            self._done += len(run)
            let_go(len(run))
            self._progress.set()

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

    def _held(self) -> int:
        return sum(len(window.offsets) for window in self._windows.values())

    async def _commit_prefixes(self) -> None:
        if self.before_commit is not None:
            await asyncio.gather(*self._tasks(), return_exceptions=True)
        assigned = self.consumer.assignment()
        for tp in [tp for tp in self._windows if tp not in assigned]:
            self._forget(tp)  # the group gave it to another process: its offsets are not ours
        offsets = {tp: end for tp, w in self._windows.items() if (end := w.prefix()) is not None}
        if not offsets:
            return
        if self.before_commit is not None:
            await self.before_commit(self._done)
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as error:
            # The group moved the partitions elsewhere meanwhile: the new owner reads them
            # again from the last commit, and finds the commands applied (their records).
            log.warning("ingest.commit_failed", tier=self.tier, error=str(error))

    def _forget(self, tp: TopicPartition) -> None:
        """Drop a partition's window; lanes still working on it finish there (their
        commands answer as applied when read again, by this process or another)."""
        self._windows.pop(tp, None)
        for key in [k for k in self._queues if k[0] == tp]:
            del self._queues[key]
            lane = self._lanes.pop(key, None)
            if lane is not None:
                self._retired.add(lane)

    def backlog(self) -> dict[str, Backlog]:
        """What each tenant has here, fetched and not yet done (``-``: not verified)."""
        held: dict[str, Backlog] = {}
        for (_, tenant), queue in self._queues.items():
            records = [item.record for run in queue for item in run]
            if not records:
                continue
            times = [r.sent_at for r in records if r.sent_at is not None]
            before = held.get(tenant, Backlog(0, None))
            oldest = min([*times, *filter(None, [before.oldest_sent_at])], default=None)
            held[tenant] = Backlog(before.records + len(records), oldest)
        return held

    async def _report(self) -> None:
        now = time.monotonic()
        if self.reports is None or now - self._reported < self.pace.report_seconds:
            return
        self._reported = now
        try:
            await self.reports.report_backlog(self.tier, self.consumer_id, self.backlog())
        except KbError as error:
            # The page's figure waits for the next report; the commands do not wait for it.
            log.warning("ingest.backlog_not_reported", tier=self.tier, code=error.code)

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
        self.metrics.lag.labels(self.tier).set(lag + self._held())


def tenant_runs(verified: list[Verified], size: int) -> dict[str, list[list[Verified]]]:
    """Each tenant's records in their order, cut in runs of at most ``size`` (an erase
    alone: it runs in transactions of its own)."""
    lanes: dict[str, list[list[Verified]]] = {}
    for item in verified:
        runs = lanes.setdefault(item.command.tenant_id, [])
        alone = isinstance(item.command, EraseDocument)
        if (
            alone
            or not runs
            or len(runs[-1]) >= size
            or isinstance(runs[-1][0].command, EraseDocument)
        ):
            runs.append([item])
        else:
            runs[-1].append(item)
    return lanes


def coalesce(queue: collections.deque[list[Any]], size: int) -> None:
    """Join the runs waiting at the front of a lane while they fit in ``size`` (never an
    erase): under load, a lane's records arrive a fetch at a time, and fewer, larger runs
    mean fewer transactions."""
    while len(queue) > 1 and len(queue[0]) + len(queue[1]) <= size:
        if any(isinstance(run[0].command, EraseDocument) for run in (queue[0], queue[1])):
            return
        first = queue.popleft()
        queue[0] = first + queue[0]
