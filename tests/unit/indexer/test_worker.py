"""The worker against the in-memory queue and fake indexers. Steps are ordered with the
worker's test-only signals and asyncio events, never with sleeps."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from structlog.testing import capture_logs

from services.indexer.ports import ClaimAllowance, IndexingOutcome
from services.indexer.queue.worker import RunOnceResult, Worker, WorkerEvent
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, IndexingFailed, IndexTask, Lease, TaskStatus
from services.runtime.errors import ConfigError, DatabaseBusy, DatabaseUnavailable
from services.runtime.pg.db import DatabaseError
from tests.fakes.task_queue import InMemoryTaskQueue, InMemoryTransaction
from tests.support.clock import ManualClock

WAIT = 5.0  # generous upper bound for an awaited signal; tests finish far sooner


class Succeeds:
    def __init__(self) -> None:
        self.seen: list[Lease] = []

    async def index(self, lease: Lease) -> IndexingOutcome:
        self.seen.append(lease)

        async def write(tx: object) -> None:
            assert isinstance(tx, InMemoryTransaction)
            tx.writes.append(("chunks", lease.task_id))

        return IndexingOutcome(write=write)


class Fails:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def index(self, lease: Lease) -> IndexingOutcome:
        raise self.error


class Hangs:
    """Blocks until released (or cancelled); records cancellation."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.running = 0
        self.max_running = 0
        self._changed = asyncio.Condition()

    async def wait_running(self, count: int) -> None:
        async with asyncio.timeout(WAIT), self._changed:
            await self._changed.wait_for(lambda: self.running == count)

    async def index(self, lease: Lease) -> IndexingOutcome:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.started.set()
        async with self._changed:
            self._changed.notify_all()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.running -= 1

        async def write(tx: object) -> None:
            assert isinstance(tx, InMemoryTransaction)
            tx.writes.append(("chunks", lease.task_id))

        return IndexingOutcome(write=write)


class WriteFails:
    """Indexing succeeds; the write it hands to ``complete`` raises inside its transaction."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def index(self, lease: Lease) -> IndexingOutcome:
        async def write(tx: object) -> None:
            assert isinstance(tx, InMemoryTransaction)
            tx.writes.append(("chunks", lease.task_id))
            raise self.error

        return IndexingOutcome(write=write)


class FlakyQueue(InMemoryTaskQueue):
    """The fake queue, with errors to raise from the next claims and heartbeats first."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.claim_errors: list[Exception] = []
        self.heartbeat_errors: list[Exception] = []
        self.claim_limits: list[int] = []  # the ``limit`` of every claim asked for

    async def claim(
        self, tier: str, owner: str, *, lease_seconds: float, limit: int = 1
    ) -> list[Lease]:
        self.claim_limits.append(limit)
        if self.claim_errors:
            raise self.claim_errors.pop(0)
        return await super().claim(tier, owner, lease_seconds=lease_seconds, limit=limit)

    async def heartbeat(self, lease: Lease, *, lease_seconds: float) -> Lease:
        if self.heartbeat_errors:
            raise self.heartbeat_errors.pop(0)
        return await super().heartbeat(lease, lease_seconds=lease_seconds)


def make(
    indexer: object, *, lease: float = 30.0, **options: object
) -> tuple[Worker, FlakyQueue, ManualClock, asyncio.Queue[WorkerEvent]]:
    clock = ManualClock(datetime.now(UTC))
    queue = FlakyQueue(clock)
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    worker = Worker(
        queue,
        indexer,  # type: ignore[arg-type]
        tier="standard",
        owner="w1",
        lease_seconds=lease,
        policy=RetryPolicy(
            backoff_base_seconds=2, backoff_cap_seconds=60, jitter=0, max_retry_after_seconds=3600
        ),
        signals=signals,
        **options,  # type: ignore[arg-type]
    )
    return worker, queue, clock, signals


async def next_event(signals: asyncio.Queue[WorkerEvent], kind: str) -> WorkerEvent:
    async with asyncio.timeout(WAIT):
        while True:
            event = await signals.get()
            if event.kind == kind:
                return event


async def test_idle_when_nothing_is_due() -> None:
    worker, queue, _, _ = make(Succeeds())
    queue.new_task(tier="premium")
    assert await worker.run_once() is RunOnceResult.IDLE


async def test_success_completes_and_commits_the_sink_writes_with_it() -> None:
    indexer = Succeeds()
    worker, queue, _, _ = make(indexer)
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.SUCCEEDED
    done = await queue.get(task.task_id)
    assert done is not None
    assert done.status is TaskStatus.SUCCEEDED
    assert queue.committed_writes == [("chunks", task.task_id)]
    assert indexer.seen[0].lease_attempt == 1


async def test_terminal_failure_is_dead_with_its_code() -> None:
    error = IndexingFailed(ErrorCode.DOCUMENT_PARSE_FAILED, "not a PDF")
    worker, queue, _, signals = make(Fails(error))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    dead = await queue.get(task.task_id)
    assert dead is not None
    assert (dead.status, dead.error_code) == (TaskStatus.DEAD, ErrorCode.DOCUMENT_PARSE_FAILED)
    assert (await next_event(signals, "failed")).detail == "DOCUMENT_PARSE_FAILED DEAD"


async def test_rate_limit_waits_for_retry_after() -> None:
    error = IndexingFailed(ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=90)
    worker, queue, clock, _ = make(Fails(error))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    waiting = await queue.get(task.task_id)
    assert waiting is not None
    assert waiting.status is TaskStatus.RETRY_WAIT
    assert waiting.next_attempt_at == clock.now() + timedelta(seconds=90)
    assert await worker.run_once() is RunOnceResult.IDLE
    clock.advance(90)
    assert await worker.run_once() is RunOnceResult.FAILED  # the retry ran (and failed again)


async def test_a_bug_is_dead_as_internal_error_not_retried() -> None:
    worker, queue, _, _ = make(Fails(KeyError("chunk")))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    dead = await queue.get(task.task_id)
    assert dead is not None
    assert (dead.status, dead.error_code) == (TaskStatus.DEAD, ErrorCode.INTERNAL_ERROR)


async def test_a_retriable_error_waits_whatever_its_code() -> None:
    worker, queue, clock, signals = make(Fails(DatabaseBusy("statement timeout")))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    waiting = await queue.get(task.task_id)
    assert waiting is not None
    assert (waiting.status, waiting.error_code) == (TaskStatus.RETRY_WAIT, "DATABASE_BUSY")
    assert waiting.next_attempt_at == clock.now() + timedelta(seconds=2)
    assert (await next_event(signals, "failed")).detail == "DATABASE_BUSY RETRY_WAIT"


async def test_a_bug_in_the_write_inside_complete_is_dead_after_one_attempt() -> None:
    worker, queue, _, signals = make(WriteFails(KeyError("chunk_id")))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    dead = await queue.get(task.task_id)
    assert dead is not None
    assert (dead.status, dead.error_code, dead.attempts) == (
        TaskStatus.DEAD,
        ErrorCode.INTERNAL_ERROR,
        1,
    )
    assert dead.error_message is not None
    assert "KeyError" in dead.error_message
    assert queue.committed_writes == []  # the transaction rolled back with it
    assert (await next_event(signals, "failed")).detail == "INTERNAL_ERROR DEAD"


async def test_a_transient_error_inside_complete_is_retried_with_backoff() -> None:
    worker, queue, clock, _ = make(WriteFails(DatabaseBusy("lock timeout")))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    waiting = await queue.get(task.task_id)
    assert waiting is not None
    assert (waiting.status, waiting.error_code) == (TaskStatus.RETRY_WAIT, "DATABASE_BUSY")
    assert waiting.next_attempt_at == clock.now() + timedelta(seconds=2)


async def test_a_heartbeat_rides_out_a_transient_error_within_its_lease() -> None:
    indexer = Hangs()
    worker, queue, _, signals = make(indexer, lease=0.6)
    queue.heartbeat_errors.append(DatabaseBusy("statement timeout"))
    task = queue.new_task()
    running = asyncio.create_task(worker.run_once())
    await next_event(signals, "heartbeat")  # the beat after the failed one got through
    indexer.release.set()
    assert await running is RunOnceResult.SUCCEEDED
    assert not indexer.cancelled
    assert (await queue.get(task.task_id)).status is TaskStatus.SUCCEEDED  # type: ignore[union-attr]


async def test_a_heartbeat_gives_up_at_once_on_a_permanent_error() -> None:
    indexer = Hangs()
    worker, queue, _, _ = make(indexer, lease=0.3)
    queue.heartbeat_errors.append(DatabaseError("UndefinedTableError: no index_task"))
    queue.new_task()
    assert await worker.run_once() is RunOnceResult.LOST_LEASE
    assert indexer.cancelled
    assert queue.committed_writes == []


async def test_heartbeats_keep_a_long_task_alive() -> None:
    indexer = Hangs()
    worker, queue, _, signals = make(indexer, lease=0.3)
    task = queue.new_task()
    running = asyncio.create_task(worker.run_once())
    for _ in range(3):
        await next_event(signals, "heartbeat")
    indexer.release.set()
    assert await running is RunOnceResult.SUCCEEDED
    assert (await queue.get(task.task_id)) is not None


async def test_lost_lease_cancels_the_work_and_writes_nothing() -> None:
    indexer = Hangs()
    worker, queue, clock, signals = make(indexer, lease=0.3)
    task = queue.new_task()
    running = asyncio.create_task(worker.run_once())
    await next_event(signals, "claimed")
    await indexer.started.wait()

    clock.advance(1)  # the lease expires; another worker takes the task over
    [takeover] = await queue.claim("standard", "w2", lease_seconds=30)
    taken = await queue.get(task.task_id)

    assert await running is RunOnceResult.LOST_LEASE
    assert indexer.cancelled
    assert queue.committed_writes == []
    assert await queue.get(task.task_id) == taken
    await queue.complete(takeover)


async def test_lost_lease_at_complete_writes_nothing() -> None:
    indexer = Hangs()
    worker, queue, clock, _ = make(indexer, lease=30)
    task = queue.new_task()
    running = asyncio.create_task(worker.run_once())
    await indexer.started.wait()
    clock.advance(31)
    await queue.claim("standard", "w2", lease_seconds=30)
    indexer.release.set()  # the work finishes, but the lease is gone
    assert await running is RunOnceResult.LOST_LEASE
    assert queue.committed_writes == []
    current = await queue.get(task.task_id)
    assert current is not None
    assert (current.lease_owner, current.attempts) == ("w2", 2)


async def test_run_keeps_concurrency_slots_busy_and_stops_cleanly() -> None:
    indexer = Hangs()
    worker, queue, _, signals = make(indexer, concurrency=3, poll_interval_seconds=0.05)
    tasks = [queue.new_task(tenant_id=f"t{i % 2}") for i in range(7)]
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await indexer.wait_running(3)
    indexer.release.set()
    for _ in range(7):
        await next_event(signals, "completed")
    stop.set()
    await asyncio.wait_for(loop, WAIT)
    assert indexer.max_running == 3
    for task in tasks:
        done = await queue.get(task.task_id)
        assert done is not None
        assert done.status is TaskStatus.SUCCEEDED


async def test_stop_lets_running_tasks_finish_within_the_grace_period() -> None:
    indexer = Hangs()
    worker, queue, _, signals = make(
        indexer, concurrency=2, poll_interval_seconds=0.05, grace_period_seconds=WAIT
    )
    first = queue.new_task()
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await next_event(signals, "claimed")
    stop.set()
    await next_event(signals, "stopping")
    late = queue.new_task()  # arrives after stop: must not be claimed
    indexer.release.set()
    await asyncio.wait_for(loop, WAIT)
    assert (await queue.get(first.task_id)).status is TaskStatus.SUCCEEDED  # type: ignore[union-attr]
    assert (await queue.get(late.task_id)).status is TaskStatus.PENDING  # type: ignore[union-attr]


async def test_grace_period_over_abandons_the_task_to_its_lease() -> None:
    indexer = Hangs()
    worker, queue, _, signals = make(indexer, grace_period_seconds=0.05)
    task = queue.new_task()
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await next_event(signals, "claimed")
    stop.set()
    await asyncio.wait_for(loop, WAIT)
    assert indexer.cancelled
    await next_event(signals, "cancelled")
    left = await queue.get(task.task_id)
    assert left is not None
    assert left.status is TaskStatus.RUNNING  # nothing written; the lease will expire


async def test_wake_claims_without_waiting_for_the_poll_timer() -> None:
    # Even the shortest idle pause is 300 s or more: within the WAIT (5 s) the only thing
    # that can make the worker claim again is wake().
    worker, queue, _, signals = make(
        Succeeds(), poll_interval_seconds=600, idle_backoff_min_seconds=600
    )
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await next_event(signals, "idle")  # the first claim found nothing; the next poll is far
    task = queue.new_task()
    worker.wake()
    await next_event(signals, "completed")
    stop.set()
    await asyncio.wait_for(loop, WAIT)
    assert (await queue.get(task.task_id)).status is TaskStatus.SUCCEEDED  # type: ignore[union-attr]


async def test_failed_claims_do_not_end_the_loop() -> None:
    worker, queue, _, signals = make(Succeeds(), poll_interval_seconds=0.05)
    queue.claim_errors += [
        DatabaseBusy("canceling statement due to statement timeout"),
        DatabaseError("InternalServerError: something odd"),  # not retriable: still no exit
        RuntimeError("a bug in the adapter"),
    ]
    task = queue.new_task()
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    details = [(await next_event(signals, "claim_failed")).detail for _ in range(3)]
    assert details == ["DATABASE_BUSY", "DATABASE_ERROR", ErrorCode.INTERNAL_ERROR]
    await next_event(signals, "completed")
    assert not loop.done()
    stop.set()
    await asyncio.wait_for(loop, WAIT)
    assert (await queue.get(task.task_id)).status is TaskStatus.SUCCEEDED  # type: ignore[union-attr]


async def test_a_configuration_error_from_claim_ends_the_loop() -> None:
    worker, queue, _, signals = make(Succeeds())
    queue.claim_errors.append(ConfigError("database configuration: bad sslmode"))
    with pytest.raises(ConfigError):
        await asyncio.wait_for(worker.run(asyncio.Event()), WAIT)
    await next_event(signals, "stopped")


def test_concurrency_must_be_positive() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        make(Succeeds(), concurrency=0)


class SlowWrites(FlakyQueue):
    """Each ``complete`` waits for its own release: results stay unwritten on demand."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.writing: list[Lease] = []
        self.write_started = asyncio.Condition()
        self.release_writes = asyncio.Event()

    async def wait_writing(self, count: int) -> None:
        async with asyncio.timeout(WAIT), self.write_started:
            await self.write_started.wait_for(lambda: len(self.writing) >= count)

    async def complete(self, lease: Lease, *, in_transaction: object = None) -> None:
        self.writing.append(lease)
        async with self.write_started:
            self.write_started.notify_all()
        await self.release_writes.wait()
        await super().complete(lease, in_transaction=in_transaction)  # type: ignore[arg-type]


def make_slow_writes(
    indexer: object, **options: object
) -> tuple[Worker, SlowWrites, asyncio.Queue[WorkerEvent]]:
    queue = SlowWrites(ManualClock(datetime.now(UTC)))
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    worker = Worker(
        queue,
        indexer,  # type: ignore[arg-type]
        tier="standard",
        owner="w1",
        signals=signals,
        poll_interval_seconds=0.05,
        **options,  # type: ignore[arg-type]
    )
    return worker, queue, signals


async def test_a_slot_claims_its_next_task_while_the_last_result_is_written() -> None:
    indexer = Succeeds()
    worker, queue, signals = make_slow_writes(indexer, concurrency=1)
    tasks = [queue.new_task() for _ in range(4)]
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    # With one slot: task 1's write is held, yet task 2 is claimed and indexed, and its
    # write starts too. Then claims pause: two unwritten results are more than one slot.
    await queue.wait_writing(2)
    assert len(indexer.seen) == 2
    statuses = [(await queue.get(t.task_id)).status for t in tasks]  # type: ignore[union-attr]
    assert sorted(statuses) == sorted([TaskStatus.RUNNING] * 2 + [TaskStatus.PENDING] * 2)
    assert queue.committed_writes == []  # nothing counts as done before its write commits
    queue.release_writes.set()
    for _ in range(4):
        await next_event(signals, "completed")
    stop.set()
    await asyncio.wait_for(loop, WAIT)
    assert sorted(lease.task_id for lease in queue.writing) == sorted(t.task_id for t in tasks)
    assert len(queue.committed_writes) == 4


async def test_stop_waits_for_results_still_being_written() -> None:
    worker, queue, signals = make_slow_writes(Succeeds(), concurrency=1, grace_period_seconds=WAIT)
    task = queue.new_task()
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await queue.wait_writing(1)
    stop.set()
    await next_event(signals, "stopping")
    assert not loop.done()
    queue.release_writes.set()
    await asyncio.wait_for(loop, WAIT)
    assert (await queue.get(task.task_id)).status is TaskStatus.SUCCEEDED  # type: ignore[union-attr]


async def test_a_write_left_after_the_grace_period_is_cancelled_and_writes_nothing() -> None:
    worker, queue, _ = make_slow_writes(Succeeds(), concurrency=1, grace_period_seconds=0.05)
    task = queue.new_task()
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await queue.wait_writing(1)
    stop.set()
    await asyncio.wait_for(loop, WAIT)
    left = await queue.get(task.task_id)
    assert left is not None
    assert left.status is TaskStatus.RUNNING  # the lease will expire; another worker redoes it
    assert queue.committed_writes == []


async def test_a_retry_after_of_decades_parks_the_task_to_the_end_of_its_budget() -> None:
    # A Retry-After of 1e9 s once parked the task for ~32 years, then ended it DEAD at once;
    # now it waits to the end of the provider budget (24 h) at the most.
    error = IndexingFailed(ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=1e9)
    worker, queue, clock, signals = make(Fails(error))
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    parked = await queue.get(task.task_id)
    assert parked is not None
    assert (parked.status, parked.error_code) == (
        TaskStatus.RETRY_WAIT,
        ErrorCode.EMBEDDING_RATE_LIMITED,
    )
    assert parked.next_attempt_at == clock.now() + timedelta(days=1)
    assert (await next_event(signals, "failed")).detail == "EMBEDDING_RATE_LIMITED RETRY_WAIT"
    # The next try, at the budget's end, fails too: the budget is spent, and the worker
    # reports where the task went (DEAD), not what the policy first proposed.
    clock.advance(86_400)
    assert await worker.run_once() is RunOnceResult.FAILED
    dead = await queue.get(task.task_id)
    assert dead is not None
    assert (dead.status, dead.error_code) == (TaskStatus.DEAD, ErrorCode.EMBEDDING_RATE_LIMITED)
    assert dead.error_message is not None
    assert "KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS" in dead.error_message
    assert (await next_event(signals, "failed")).detail == "EMBEDDING_RATE_LIMITED DEAD"


class CommitLost(FlakyQueue):
    """``complete`` loses its connection around COMMIT: ``committed`` says whether the
    commit landed before the connection went; ``takeover`` lets another worker claim the
    task in between; ``get_errors`` make the re-read fail too."""

    def __init__(self, clock: ManualClock, *, committed: bool, takeover: bool = False) -> None:
        super().__init__(clock)
        self.committed = committed
        self.takeover = takeover
        self.get_errors: list[Exception] = []
        self.gets = 0

    async def complete(self, lease: Lease, *, in_transaction: object = None) -> None:
        if self.committed:
            await super().complete(lease, in_transaction=in_transaction)  # type: ignore[arg-type]
        elif self.takeover:
            self._clock.advance(31)  # type: ignore[attr-defined]
            await super().claim(lease.tier, "w2", lease_seconds=30)
        raise DatabaseUnavailable("database unreachable: connection lost during COMMIT")

    async def get(self, task_id: uuid.UUID) -> IndexTask | None:
        self.gets += 1
        if self.get_errors:
            raise self.get_errors.pop(0)
        return await super().get(task_id)


def make_commit_lost(
    *, committed: bool, takeover: bool = False, lease: float = 30.0
) -> tuple[Worker, CommitLost, asyncio.Queue[WorkerEvent]]:
    queue = CommitLost(ManualClock(datetime.now(UTC)), committed=committed, takeover=takeover)
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    worker = Worker(
        queue,
        Succeeds(),
        tier="standard",
        owner="w1",
        lease_seconds=lease,
        policy=RetryPolicy(backoff_base_seconds=2, backoff_cap_seconds=60, jitter=0),
        signals=signals,
    )
    return worker, queue, signals


async def test_a_commit_that_landed_before_the_connection_dropped_is_succeeded() -> None:
    # Defect 9: this was reported LOST_LEASE (the fail after it found the task SUCCEEDED).
    worker, queue, signals = make_commit_lost(committed=True)
    queue.get_errors.append(DatabaseUnavailable("still reconnecting"))  # the re-read retries
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.SUCCEEDED
    done = await queue.get(task.task_id)
    assert done is not None
    assert (done.status, done.attempts) == (TaskStatus.SUCCEEDED, 1)
    assert queue.committed_writes == [("chunks", task.task_id)]
    await next_event(signals, "completed")


async def test_a_commit_that_did_not_land_goes_the_failure_path() -> None:
    worker, queue, signals = make_commit_lost(committed=False)
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.FAILED
    waiting = await queue.get(task.task_id)
    assert waiting is not None
    assert (waiting.status, waiting.error_code) == (TaskStatus.RETRY_WAIT, "DATABASE_UNAVAILABLE")
    assert queue.committed_writes == []
    assert (await next_event(signals, "failed")).detail == "DATABASE_UNAVAILABLE RETRY_WAIT"


async def test_a_lost_commit_of_a_task_taken_over_meanwhile_is_lost_lease() -> None:
    worker, queue, _ = make_commit_lost(committed=False, takeover=True)
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.LOST_LEASE
    current = await queue.get(task.task_id)
    assert current is not None
    assert (current.status, current.lease_owner, current.attempts) == (
        TaskStatus.RUNNING,
        "w2",
        2,
    )


async def test_an_outcome_that_cannot_be_read_back_is_an_error_not_a_guess() -> None:
    worker, queue, _ = make_commit_lost(committed=True, lease=0.3)
    queue.get_errors += [DatabaseUnavailable("down")] * 1000
    queue.new_task()
    with pytest.raises(DatabaseUnavailable):
        await asyncio.wait_for(worker.run_once(), WAIT)
    assert queue.gets > 1  # it did retry within the lease period


class SilentHeartbeats(FlakyQueue):
    """Heartbeats that never answer: the database hangs (or its pool has no connection)."""

    async def heartbeat(self, lease: Lease, *, lease_seconds: float) -> Lease:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_heartbeat_that_never_answers_gives_the_lease_up_in_time() -> None:
    # Defect 8: a heartbeat stuck waiting (for a pool connection, on a hung database) held
    # the worker past its lease, believing it still owned the task.
    indexer = Hangs()
    queue = SilentHeartbeats(ManualClock(datetime.now(UTC)))
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    worker = Worker(queue, indexer, tier="standard", owner="w1", lease_seconds=0.3, signals=signals)
    queue.new_task()
    assert await asyncio.wait_for(worker.run_once(), WAIT) is RunOnceResult.LOST_LEASE
    assert indexer.cancelled
    assert queue.committed_writes == []


class SlowFirstAnswer(FlakyQueue):
    """The database extends the lease when the first heartbeat arrives, but its answer
    takes ``skew`` seconds (of the worker's clock) to come back; the second heartbeat fails
    transiently; later ones succeed."""

    def __init__(self, clock: ManualClock, skew: float) -> None:
        super().__init__(clock)
        self.skew = skew
        self.offset = 0.0
        self.beats = 0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    async def heartbeat(self, lease: Lease, *, lease_seconds: float) -> Lease:
        self.beats += 1
        if self.beats == 2:
            raise DatabaseBusy("statement timeout")
        extended = await super().heartbeat(lease, lease_seconds=lease_seconds)
        if self.beats == 1:
            self.offset += self.skew
        return extended


async def test_the_local_lease_deadline_counts_from_before_the_round_trip() -> None:
    # Defect 8: the deadline was counted from when the answer arrived, so a slow round trip
    # made the worker believe in a lease the database had already let run out.
    indexer = Hangs()
    queue = SlowFirstAnswer(ManualClock(datetime.now(UTC)), skew=0.28)
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    worker = Worker(queue, indexer, tier="standard", owner="w1", lease_seconds=0.3, signals=signals)
    worker.attempts.monotonic = queue.monotonic
    queue.new_task()
    running = asyncio.create_task(worker.run_once())
    # First beat sent at s, answered at s + 0.28: the lease ends at s + 0.3 in our view.
    # The second beat fails at about s + 0.28 + 0.1: past it, so the lease is given up.
    await next_event(signals, "lease_lost")
    assert await asyncio.wait_for(running, WAIT) is RunOnceResult.LOST_LEASE
    assert indexer.cancelled


# --- the claim gate (the embedding provider's breaker and pause) -------------------------------


class FakeGate:
    """Answers the worker's questions in order (the last answer repeats); an exception among
    the answers is raised instead."""

    def __init__(self, *answers: ClaimAllowance | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    async def claim_allowance(self, owner: str) -> ClaimAllowance:
        self.asked.append(owner)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


OPEN = ClaimAllowance(None, None, None)


def drained(signals: asyncio.Queue[WorkerEvent]) -> list[str]:
    kinds = []
    while not signals.empty():
        kinds.append(signals.get_nowait().kind)
    return kinds


async def test_a_closed_gate_claims_nothing_and_spends_no_attempt() -> None:
    # Every pause the worker could take on its own is 600 s: within WAIT (5 s) only the gate's
    # answer and stop decide what happens.
    gate = FakeGate(ClaimAllowance(0, 3600.0, "breaker_open"))
    worker, queue, _, signals = make(
        Succeeds(), gate=gate, poll_interval_seconds=600, idle_backoff_min_seconds=600
    )
    task = queue.new_task()
    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(worker.run(stop))
        gated = await next_event(signals, "gated")
        assert (gated.detail, gated.seconds) == ("breaker_open", 600)  # capped at the poll
        worker.wake()  # a Kafka hint does not end the gate's wait
        for _ in range(50):
            await asyncio.sleep(0)
        assert gate.asked == ["w1"]
        stop.set()  # stop does
        await asyncio.wait_for(loop, WAIT)
    assert "claimed" not in drained(signals)
    assert queue.claim_limits == []
    left = await queue.get(task.task_id)
    assert left is not None
    assert (left.status, left.attempts, left.max_attempts) == (TaskStatus.PENDING, 0, 8)
    assert [(e["event"], e.get("reason")) for e in logs if e["event"] == "worker.gated"] == [
        ("worker.gated", "breaker_open")
    ]


async def test_gated_is_logged_when_its_reason_changes_and_claims_resume_when_open() -> None:
    gate = FakeGate(
        ClaimAllowance(0, 0.0, "paused"),
        ClaimAllowance(0, 0.0, "paused"),
        ClaimAllowance(0, None, "breaker_open"),
        OPEN,
    )
    worker, queue, _, signals = make(
        Succeeds(), gate=gate, poll_interval_seconds=0.05, idle_backoff_min_seconds=0.01
    )
    task = queue.new_task()
    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(worker.run(stop))
        reasons = [(await next_event(signals, "gated")).detail for _ in range(3)]
        await next_event(signals, "completed")
        stop.set()
        await asyncio.wait_for(loop, WAIT)
    assert reasons == ["paused", "paused", "breaker_open"]
    events = [(e["event"], e.get("reason", e.get("was"))) for e in logs]
    assert [e for e in events if e[0] in ("worker.gated", "worker.ungated")] == [
        ("worker.gated", "paused"),
        ("worker.gated", "breaker_open"),
        ("worker.ungated", "breaker_open"),
    ]
    done = await queue.get(task.task_id)
    assert done is not None
    assert (done.status, done.attempts) == (TaskStatus.SUCCEEDED, 1)


@pytest.mark.parametrize(
    ("limit", "concurrency", "claimed"),
    [(1, 3, 1), (2, 4, 2), (5, 2, 2), (None, 3, 3)],
)
async def test_a_gate_limit_caps_the_claim(
    limit: int | None, concurrency: int, claimed: int
) -> None:
    # limit 1: the breaker's probe -- one task, and then nothing until it is decided.
    indexer = Hangs()
    gate = FakeGate(ClaimAllowance(limit, None, "probing"), ClaimAllowance(0, 3600.0, "probing"))
    worker, queue, _, signals = make(
        indexer,
        gate=gate,
        concurrency=concurrency,
        poll_interval_seconds=600,
        idle_backoff_min_seconds=600,
    )
    for _ in range(6):
        queue.new_task()
    stop = asyncio.Event()
    loop = asyncio.create_task(worker.run(stop))
    await indexer.wait_running(claimed)
    if claimed < concurrency:
        await next_event(signals, "gated")  # asked again for the free slots: no
    assert queue.claim_limits == [claimed]
    assert len(await queue.list_tasks(status=TaskStatus.RUNNING)) == claimed
    waiting = await queue.list_tasks(status=TaskStatus.PENDING)
    assert len(waiting) == 6 - claimed
    assert all(task.attempts == 0 for task in waiting)
    indexer.release.set()
    stop.set()
    await asyncio.wait_for(loop, WAIT)


async def test_a_failing_gate_is_logged_and_the_claim_goes_ahead() -> None:
    gate = FakeGate(DatabaseUnavailable("provider state unreachable"), RuntimeError("a bug"))
    worker, queue, _, signals = make(Succeeds(), gate=gate, poll_interval_seconds=0.05)
    first, second = queue.new_task(), queue.new_task()
    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(worker.run(stop))
        for _ in range(2):
            await next_event(signals, "completed")
        stop.set()
        await asyncio.wait_for(loop, WAIT)
    for task in (first, second):
        assert (await queue.get(task.task_id)).status is TaskStatus.SUCCEEDED  # type: ignore[union-attr]
    failed = [e for e in logs if e["event"] == "worker.gate_failed"]
    assert failed[0]["error_code"] == "DATABASE_UNAVAILABLE"
    assert failed[1]["log_level"] == "error"  # a bug: logged with its traceback
    assert "gated" not in drained(signals)


async def test_run_once_asks_the_gate_too() -> None:
    gate = FakeGate(ClaimAllowance(0, 5.0, "paused"), OPEN)
    worker, queue, _, signals = make(Succeeds(), gate=gate)
    task = queue.new_task()
    assert await worker.run_once() is RunOnceResult.IDLE
    assert (await next_event(signals, "gated")).detail == "paused"
    untouched = await queue.get(task.task_id)
    assert untouched is not None
    assert (untouched.status, untouched.attempts) == (TaskStatus.PENDING, 0)
    assert await worker.run_once() is RunOnceResult.SUCCEEDED
