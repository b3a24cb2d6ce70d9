"""The claim loop: claim, heartbeat at lease/3, index, then complete or fail (DESIGN §4, §6).

``run_once`` does one task; ``Worker.run`` keeps ``concurrency`` slots busy, polls on a timer
with jittered idle backoff, wakes early on ``wake()`` (the hook for Kafka hints) and on
``stop`` finishes running tasks within the grace period.

A lost lease (a heartbeat, complete or fail that the fence refuses) stops the heartbeat,
cancels the indexing work and writes nothing: the new owner carries on.

Every failure of an attempt -- in the indexing work or in ``complete`` (the sink's write
runs in its transaction) -- goes through the retry policy and the fenced ``fail``. A failed
claim never ends ``run`` (only a configuration error does): the loop logs it and tries again
after a jittered, capped backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.indexer.ports import DocumentVersionIndexer, IndexingOutcome, TaskQueue
from services.indexer.task import ErrorCode, IndexingFailed, Lease, RetryPolicy
from services.runtime.errors import ConfigError, KbError, LeaseLost
from services.runtime.logging import get_logger

log = get_logger(__name__)


class RunOnceResult(enum.StrEnum):
    IDLE = "IDLE"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    LOST_LEASE = "LOST_LEASE"


@dataclass(frozen=True)
class WorkerEvent:
    """Test-only signal: what just happened ("claimed", "heartbeat", "lease_lost",
    "completed", "failed", "idle", "claim_failed", "stopping", "stopped", "cancelled")."""

    kind: str
    task_id: uuid.UUID | None = None
    detail: str | None = None


def default_worker_id() -> str:
    """host:pid:random. A restarted process is a new owner even on the same host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class _LeaseState:
    lost: bool = False


@dataclass(frozen=True)
class _Failure:
    """Why an attempt failed, as the retry policy needs it: code and flag, never message."""

    code: str
    message: str
    retry_after_seconds: float | None = None
    retriable: bool = False

    @classmethod
    def of(cls, error: Exception) -> _Failure:
        if isinstance(error, IndexingFailed):
            return cls(error.code, error.message, error.retry_after_seconds, error.retriable)
        if isinstance(error, KbError):
            return cls(error.code, error.message, None, error.retriable)
        # A bug, not a transient condition: DEAD with INTERNAL_ERROR.
        return cls(ErrorCode.INTERNAL_ERROR, f"{type(error).__name__}: {error}")


@dataclass(frozen=True)
class _Attempt:
    """An indexing run that ended, before its result is written."""

    lease: Lease
    outcome: IndexingOutcome | None
    failure: _Failure | None
    lost: bool
    log_context: dict[str, object]  # the task's log fields, built once per task


class Worker:
    def __init__(
        self,
        queue: TaskQueue,
        indexer: DocumentVersionIndexer,
        *,
        tier: str,
        owner: str | None = None,
        lease_seconds: float = 30.0,
        policy: RetryPolicy | None = None,
        concurrency: int = 1,
        poll_interval_seconds: float = 5.0,
        idle_backoff_min_seconds: float = 0.05,
        grace_period_seconds: float = 30.0,
        signals: asyncio.Queue[WorkerEvent] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.queue = queue
        self.indexer = indexer
        self.tier = tier
        self.owner = owner or default_worker_id()
        self.lease_seconds = lease_seconds
        self.policy = policy or RetryPolicy()
        self.concurrency = concurrency
        self.poll_interval_seconds = poll_interval_seconds
        self.idle_backoff_min_seconds = min(idle_backoff_min_seconds, poll_interval_seconds)
        self.grace_period_seconds = grace_period_seconds
        self._signals = signals
        self._rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._wake_waiter: asyncio.Task[bool] | None = None

    # --- one task ---------------------------------------------------------------------------

    async def run_once(self) -> RunOnceResult:
        """Claim one task of the tier and see it through; IDLE when nothing is due."""
        leases = await self.queue.claim(
            self.tier, self.owner, lease_seconds=self.lease_seconds, limit=1
        )
        if not leases:
            self._emit(WorkerEvent("idle"))
            return RunOnceResult.IDLE
        return await self.process(leases[0])

    async def process(self, lease: Lease) -> RunOnceResult:
        """Index a claimed task under its lease and record the result (fenced)."""
        return await self._record(await self._index(lease))

    async def _index(self, lease: Lease) -> _Attempt:
        """The indexing work under the lease, heartbeating at lease/3. Cancelled from
        outside (the grace period ran out), it writes nothing and re-raises: the lease
        expires and another worker takes the task over."""
        context = self._context(lease)
        log.info("task.claimed", **context)
        self._emit(WorkerEvent("claimed", lease.task_id, str(lease.lease_attempt)))
        state = _LeaseState()
        claimed_at = time.monotonic()
        work: asyncio.Task[IndexingOutcome] = asyncio.create_task(self.indexer.index(lease))
        # The heartbeat task starts at the first beat: most short tasks never need one.
        beats: list[asyncio.Task[None]] = []
        first_beat = asyncio.get_running_loop().call_later(
            self.lease_seconds / 3,
            lambda: beats.append(
                asyncio.create_task(self._heartbeat(lease, work, state, claimed_at))
            ),
        )
        outcome: IndexingOutcome | None = None
        failure: _Failure | None = None
        try:
            outcome = await work
        except asyncio.CancelledError:
            if not state.lost:
                log.warning("task.abandoned", **context)
                self._emit(WorkerEvent("cancelled", lease.task_id))
                raise
        except Exception as error:
            if not isinstance(error, KbError):
                # A bug: its traceback is logged.
                log.exception("task.crashed", **context)
            failure = _Failure.of(error)
        finally:
            first_beat.cancel()
            for beat in beats:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
        return _Attempt(lease, outcome, failure, state.lost, context)

    async def _record(self, attempt: _Attempt) -> RunOnceResult:
        """Write the attempt's result: complete (with the sink's write in its transaction)
        or the retry policy's fail; both fenced, so a lost lease writes nothing."""
        lease, context = attempt.lease, attempt.log_context
        if attempt.lost:
            return self._lost(lease)
        failure = attempt.failure
        if failure is None:
            outcome = attempt.outcome
            assert outcome is not None
            try:
                await self.queue.complete(lease, in_transaction=outcome.write)
            except LeaseLost:
                return self._lost(lease)
            except Exception as error:
                # The result (or the sink's write in its transaction) was not recorded:
                # the same policy as a failed indexing run, not a silent lease expiry.
                if isinstance(error, KbError):
                    log.warning("task.complete_failed", error=str(error), **context)
                else:
                    log.exception("task.complete_crashed", **context)
                failure = _Failure.of(error)
            else:
                log.info("task.completed", **context)
                self._emit(WorkerEvent("completed", lease.task_id))
                return RunOnceResult.SUCCEEDED
        decision = self.policy.decide(
            lease,
            failure.code,
            failure.message,
            retry_after_seconds=failure.retry_after_seconds,
            retriable=failure.retriable,
            rng=self._rng,
        )
        try:
            await self.queue.fail(lease, decision)
        except LeaseLost:
            return self._lost(lease)
        log.info(
            "task.failed",
            **context,
            error_code=failure.code,
            next_status=str(decision.status),
            delay_seconds=round(decision.delay_seconds, 3),
        )
        self._emit(WorkerEvent("failed", lease.task_id, f"{failure.code} {decision.status}"))
        return RunOnceResult.FAILED

    def _context(self, lease: Lease) -> dict[str, object]:
        return {
            "task_id": str(lease.task_id),
            "tenant_id": lease.tenant_id,
            "document_id": str(lease.document_id),
            "version_number": lease.version_number,
            "lease_attempt": lease.lease_attempt,
            "owner": self.owner,
        }

    def _lost(self, lease: Lease) -> RunOnceResult:
        log.warning(
            "lease.lost",
            task_id=str(lease.task_id),
            lease_attempt=lease.lease_attempt,
            owner=self.owner,
        )
        self._emit(WorkerEvent("lease_lost", lease.task_id))
        return RunOnceResult.LOST_LEASE

    async def _heartbeat(
        self,
        lease: Lease,
        work: asyncio.Task[IndexingOutcome],
        state: _LeaseState,
        claimed_at: float,
    ) -> None:
        """Beat now, then every lease/3 (started at the first beat, lease/3 after the claim)."""
        interval = self.lease_seconds / 3
        # Our own view of the lease: without a successful heartbeat it is gone by then,
        # whatever the database says (it may be unreachable).
        deadline = claimed_at + self.lease_seconds
        current = lease
        while True:
            try:
                current = await self.queue.heartbeat(current, lease_seconds=self.lease_seconds)
                deadline = time.monotonic() + self.lease_seconds
                self._emit(WorkerEvent("heartbeat", lease.task_id))
            except LeaseLost:
                state.lost = True
            except KbError as error:
                # Unconfirmed is not held: retry a transient error (database busy or
                # unreachable) at the next beat until our own view of the lease runs out;
                # give up at once on anything else.
                log.warning("lease.heartbeat_failed", task_id=str(lease.task_id), error=str(error))
                if not error.retriable or time.monotonic() >= deadline:
                    state.lost = True
            except Exception:
                log.exception("lease.heartbeat_crashed", task_id=str(lease.task_id))
                state.lost = True
            if state.lost:
                work.cancel()
                return
            await asyncio.sleep(interval)

    # --- the loop ---------------------------------------------------------------------------

    def wake(self) -> None:
        """Claim now instead of at the next poll (a Kafka hint arrived)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Keep up to ``concurrency`` tasks indexing until ``stop`` is set; then claim nothing
        more, give running tasks ``grace_period_seconds`` and cancel what is left (their
        leases expire and another worker takes them over).

        A slot is the indexing work (parsing, embedding: the slow, metered part). Writing a
        task's result -- the fenced complete with the sink's transaction, or fail -- runs
        beside the slot: the slot claims its next task while the last result is written,
        so a claim and a write overlap instead of taking turns. Claims pause while more
        results wait to be written than there are slots, so a slow database holds back new
        work instead of piling results up. Nothing is acknowledged early: a result counts
        only once its write commits; a crash before that leaves the task RUNNING until its
        lease expires, and it is done again (DESIGN §4: at-least-once, fenced writes)."""
        slots: set[asyncio.Task[_Attempt]] = set()
        writes: set[asyncio.Task[RunOnceResult]] = set()
        idle_delay = self.idle_backoff_min_seconds
        failed_claims = 0
        claim_again_at = 0.0  # monotonic; after a failed claim, no claim before then
        stop_waiter = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                free = self.concurrency - len(slots)
                if len(writes) > self.concurrency:
                    free = 0
                resting = claim_again_at - time.monotonic()
                if free > 0 and resting > 0:
                    # A claim failed: neither a freed slot nor a wake-up shortens the pause.
                    slots, writes = await self._wait(
                        slots, writes, stop_waiter, resting, wakeable=False
                    )
                    continue
                claimed = 0
                if free > 0:
                    try:
                        leases = await self.queue.claim(
                            self.tier, self.owner, lease_seconds=self.lease_seconds, limit=free
                        )
                    except ConfigError:
                        raise  # nothing a retry can fix: `kb indexer run` exits
                    except Exception as error:
                        failed_claims += 1
                        pause = self._claim_backoff(failed_claims)
                        claim_again_at = time.monotonic() + pause
                        self._claim_failed(error, failed_claims, pause)
                        continue
                    failed_claims = 0
                    for lease in leases:
                        slots.add(asyncio.create_task(self._index(lease)))
                    claimed = len(leases)
                if claimed:
                    idle_delay = self.idle_backoff_min_seconds
                    if len(slots) < self.concurrency:
                        continue  # more may be due right now
                    timeout: float | None = None
                elif free > 0:
                    self._emit(WorkerEvent("idle"))
                    timeout = idle_delay * (1.0 - 0.5 * self._rng.random())
                    idle_delay = min(self.poll_interval_seconds, idle_delay * 2)
                else:
                    timeout = None
                slots, writes = await self._wait(slots, writes, stop_waiter, timeout)
        finally:
            log.info("worker.stopping", running=len(slots) + len(writes), owner=self.owner)
            self._emit(WorkerEvent("stopping"))
            stop_waiter.cancel()
            if self._wake_waiter is not None:
                self._wake_waiter.cancel()
                self._wake_waiter = None
            await self._drain(slots, writes)
            self._emit(WorkerEvent("stopped"))
            log.info("worker.stopped", owner=self.owner)

    def _claim_backoff(self, failures: int) -> float:
        """Pause after the ``failures``-th failed claim in a row: doubling from the idle
        backoff, capped at the poll interval, shortened by up to half at random (so workers
        that failed together do not return together)."""
        exponent = min(failures - 1, 60)
        capped = min(self.poll_interval_seconds, self.idle_backoff_min_seconds * 2.0**exponent)
        return capped * (1.0 - 0.5 * self._rng.random())

    def _claim_failed(self, error: Exception, failures: int, pause: float) -> None:
        code = error.code if isinstance(error, KbError) else ErrorCode.INTERNAL_ERROR
        fields = {
            "error_code": code,
            "error": str(error),
            "failures": failures,
            "retry_in_seconds": round(pause, 3),
            "owner": self.owner,
        }
        if isinstance(error, KbError):
            log.warning("worker.claim_failed", **fields)
        else:
            log.exception("worker.claim_failed", **fields)  # a bug: keep its traceback
        self._emit(WorkerEvent("claim_failed", detail=code))

    async def _wait(
        self,
        slots: set[asyncio.Task[_Attempt]],
        writes: set[asyncio.Task[RunOnceResult]],
        stop_waiter: asyncio.Task[bool],
        wait_seconds: float | None,
        *,
        wakeable: bool = True,
    ) -> tuple[set[asyncio.Task[_Attempt]], set[asyncio.Task[RunOnceResult]]]:
        """Until a slot frees or a write ends, a wake-up (if ``wakeable``), stop, or the
        timeout; returns the slots still indexing and the writes still running, with a
        write started for each slot that finished."""
        waiters: set[asyncio.Future[Any]] = {stop_waiter, *slots, *writes}
        if wakeable:
            # One waiter lives until a wake-up arrives, not one per wait.
            if self._wake_waiter is None:
                self._wake_waiter = asyncio.create_task(self._wake.wait())
            waiters.add(self._wake_waiter)
        await asyncio.wait(waiters, timeout=wait_seconds, return_when=asyncio.FIRST_COMPLETED)
        if wakeable and self._wake_waiter is not None and self._wake_waiter.done():
            self._wake.clear()  # this wait consumed the wake-up
            self._wake_waiter = None
        return self._settle(slots, writes)

    def _settle(
        self, slots: set[asyncio.Task[_Attempt]], writes: set[asyncio.Task[RunOnceResult]]
    ) -> tuple[set[asyncio.Task[_Attempt]], set[asyncio.Task[RunOnceResult]]]:
        still_indexing = {t for t in slots if not t.done()}
        still_writing = {t for t in writes if not t.done()}
        for written in writes - still_writing:
            self._reap(written)
        for indexed in slots - still_indexing:
            if indexed.cancelled():
                continue
            error = indexed.exception()
            if error is not None:  # _index catches everything but cancellation: a bug
                log.error("task.indexing_crashed", error=repr(error))
                continue
            still_writing.add(asyncio.create_task(self._record(indexed.result())))
        return still_indexing, still_writing

    def _reap(self, finished: asyncio.Task[RunOnceResult]) -> None:
        if finished.cancelled():
            return
        error = finished.exception()
        if error is not None:
            # Writing the result failed (database down): the lease expires, the task is
            # taken over later. The loop itself carries on.
            log.error("task.result_not_recorded", error=repr(error))

    async def _drain(
        self, slots: set[asyncio.Task[_Attempt]], writes: set[asyncio.Task[RunOnceResult]]
    ) -> None:
        """Let running work finish and its results be written, within the grace period;
        then cancel what is left (nothing of it is written: those leases expire)."""
        deadline = time.monotonic() + self.grace_period_seconds
        while slots or writes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.wait(
                {*slots, *writes}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            slots, writes = self._settle(slots, writes)
        left: set[asyncio.Task[Any]] = {*slots, *writes}
        for task in left:
            task.cancel()
        for task in left:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for write in writes:
            self._reap(write)

    def _emit(self, event: WorkerEvent) -> None:
        if self._signals is not None:
            self._signals.put_nowait(event)


async def run_until_signalled(worker: Worker, stop: asyncio.Event) -> None:
    """``worker.run`` with SIGTERM/SIGINT setting ``stop`` (graceful shutdown)."""
    import signal

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await worker.run(stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
