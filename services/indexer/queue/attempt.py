"""One attempt at one leased task: index it under a heartbeat, then record the result.

The heartbeat renews the lease every lease/3 from the claim until the result is recorded:
while the indexing work runs, and on while its completion waits in the group queue and
commits (completions.py: behind groups moving large documents that can take longer than a
lease) or its fail is written -- but for at most ``completion_max_wait_seconds`` once the
work is done: a wedged committer (its pool starved, a lock wait with no statement timeout)
must not keep the task from every other worker. Past it the beats stop and the lease lapses:
the queue withdraws a completion still queued by then, and one committing gets its fence's
answer. A lost lease (a heartbeat, complete or fail that the fence
refuses) stops the heartbeat, cancels the work and writes nothing: the new owner carries
on. Once the work is done there is nothing to cancel: a completion still queued is
withdrawn by the queue when a heartbeat is refused, and one committing gets its own
fence's answer.

Every failure of an attempt -- in the indexing work or in ``complete`` (the sink's write
runs in its transaction) -- goes through the retry policy and the fenced ``fail``.

A connection lost while ``complete`` commits leaves its outcome unknown: the commit may have
landed. The task is read again and the attempt reports what the row says -- SUCCEEDED when
it is SUCCEEDED with this lease generation, the failure path while the lease is still ours,
LOST_LEASE otherwise -- never a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from services.indexer.ports import DocumentVersionIndexer, IndexingOutcome, TaskQueue
from services.indexer.queue.attempt_span import AttemptSpan, Claimed
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, IndexingFailed, IndexTask, Lease, TaskStatus
from services.runtime.backoff import Backoff
from services.runtime.errors import DatabaseUnavailable, KbError, LeaseLost
from services.runtime.logging import get_logger
from services.runtime.tracing.spans import mark

log = get_logger(__name__)


class RunOnceResult(enum.StrEnum):
    IDLE = "IDLE"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    LOST_LEASE = "LOST_LEASE"


@dataclass(frozen=True)
class WorkerEvent:
    """What just happened ("claimed", "heartbeat", "lease_lost", "completed", "failed",
    "idle", "claim_failed", "stopping", "stopped", "cancelled"): tests wait for these through
    the worker's ``signals`` queue, metrics count them through its ``observer``."""

    kind: str
    task_id: uuid.UUID | None = None
    detail: str | None = None
    seconds: float | None = None  # how long it took (a heartbeat's round trip)


Emit = Callable[[WorkerEvent], None]


@dataclass(frozen=True)
class AttemptFailure:
    """Why an attempt failed, as the retry policy needs it: code and flag, never message."""

    code: str
    message: str
    retry_after_seconds: float | None = None
    retriable: bool = False

    @classmethod
    def of(cls, error: Exception) -> AttemptFailure:
        if isinstance(error, IndexingFailed):
            return cls(error.code, error.message, error.retry_after_seconds, error.retriable)
        if isinstance(error, KbError):
            return cls(error.code, error.message, None, error.retriable)
        # A bug, not a transient condition: DEAD with INTERNAL_ERROR.
        return cls(ErrorCode.INTERNAL_ERROR, f"{type(error).__name__}: {error}")


@dataclass
class _LeaseState:
    """Our own view of the lease (``monotonic`` time): it runs out at ``deadline`` without a
    confirmed beat; the next beat is due at ``next_beat_at``."""

    deadline: float
    next_beat_at: float
    lost: bool = False


@dataclass(frozen=True)
class IndexedAttempt:
    """An indexing run that ended, before its result is written."""

    lease: Lease
    outcome: IndexingOutcome | None
    failure: AttemptFailure | None
    lost: bool
    log_context: dict[str, object]  # the task's log fields, built once per task
    # The lease as the heartbeat left it: recording the result beats on from there.
    lease_state: _LeaseState | None = None
    # Its span, ended once the result is written (attempt_span.py).
    span: AttemptSpan | None = None


class TaskAttempts:
    """Runs attempts for one worker: ``index`` (the slow part, under the lease) and
    ``record`` (the fenced write of its result) are separate so that a worker's slot can
    claim its next task while the last result is written."""

    def __init__(
        self,
        queue: TaskQueue,
        indexer: DocumentVersionIndexer,
        *,
        owner: str,
        lease_seconds: float,
        policy: RetryPolicy,
        rng: random.Random,
        emit: Emit,
        monotonic: Callable[[], float] = time.monotonic,
        completion_max_wait_seconds: float | None = None,
    ) -> None:
        self.queue = queue
        self.indexer = indexer
        self.owner = owner
        self.lease_seconds = lease_seconds
        # How long a finished task's lease is kept beating while its result is written.
        self.completion_max_wait_seconds = (
            4 * lease_seconds
            if completion_max_wait_seconds is None
            else completion_max_wait_seconds
        )
        self.policy = policy
        self._rng = rng
        self._emit = emit
        # Our own view of lease time (injectable: tests simulate slow round trips).
        self.monotonic = monotonic

    async def process(self, lease: Lease, claimed: Claimed | None = None) -> RunOnceResult:
        """Index a claimed task under its lease and record the result (fenced)."""
        return await self.record(await self.index(lease, claimed))

    # --- the work under the lease -------------------------------------------------------

    async def index(self, lease: Lease, claimed: Claimed | None = None) -> IndexedAttempt:
        """The indexing work under the lease, heartbeating at lease/3, in the attempt's span
        (``claimed``: how its claim went). Cancelled from outside (the grace period ran
        out), it writes nothing and re-raises: the lease expires and another worker takes
        the task over."""
        span = AttemptSpan(lease, self.owner, claimed)
        try:
            with span.current():
                indexed = await self._index(span.lease)
        except BaseException as error:
            span.end("CANCELLED", error)
            raise
        return replace(indexed, span=span)

    async def _index(self, lease: Lease) -> IndexedAttempt:
        context = self._context(lease)
        log.info("task.claimed", **context)
        self._emit(WorkerEvent("claimed", lease.task_id, str(lease.lease_attempt)))
        claimed_at = self.monotonic()
        interval = self.lease_seconds / 3
        state = _LeaseState(claimed_at + self.lease_seconds, claimed_at + interval)
        work: asyncio.Task[IndexingOutcome] = asyncio.create_task(self.indexer.index(lease))
        outcome: IndexingOutcome | None = None
        failure: AttemptFailure | None = None
        async with self._beating(lease, state, interval, on_lost=work.cancel):
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
                failure = AttemptFailure.of(error)
        return IndexedAttempt(lease, outcome, failure, state.lost, context, state)

    @contextlib.asynccontextmanager
    async def _beating(
        self,
        lease: Lease,
        state: _LeaseState,
        first_in: float,
        *,
        on_lost: Callable[[], Any],
        until: float | None = None,
    ) -> AsyncIterator[None]:
        """Heartbeats while the body runs, the first in ``first_in`` seconds, none sent at
        or after ``until`` (our monotonic time) if given. The heartbeat task starts at the
        first beat: most short tasks never need one."""
        beats: list[asyncio.Task[None]] = []
        first_beat = asyncio.get_running_loop().call_later(
            max(0.0, first_in),
            lambda: beats.append(
                asyncio.create_task(self._heartbeat(lease, state, on_lost, until))
            ),
        )
        try:
            yield
        finally:
            first_beat.cancel()
            for beat in beats:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat

    async def _heartbeat(
        self,
        lease: Lease,
        state: _LeaseState,
        on_lost: Callable[[], Any],
        until: float | None = None,
    ) -> None:
        """Beat now, then every lease/3.

        Our own view of the lease: it runs out ``lease_seconds`` after the last beat was
        *sent* (the claim, at first) -- the database extended it at some point during the
        round trip, so the time before it is the safe side. Without a confirmed beat by then
        the lease is gone, whatever the database says (it may be unreachable). A beat that
        does not answer within lease/3 counts as a failed one (the queue's own timeout is
        shorter still)."""
        interval = self.lease_seconds / 3
        current = lease
        while True:
            sent_at = self.monotonic()
            if until is not None and sent_at >= until:
                # The result has waited too long to be written: the lease is let go.
                log.warning(
                    "lease.released",
                    task_id=str(lease.task_id),
                    lease_attempt=lease.lease_attempt,
                    owner=self.owner,
                    reason="completion_max_wait",
                    max_wait_seconds=self.completion_max_wait_seconds,
                )
                return
            try:
                async with asyncio.timeout(interval):
                    current = await self.queue.heartbeat(current, lease_seconds=self.lease_seconds)
                state.deadline = sent_at + self.lease_seconds
                self._emit(
                    WorkerEvent("heartbeat", lease.task_id, seconds=self.monotonic() - sent_at)
                )
            except LeaseLost:
                state.lost = True
            except (KbError, TimeoutError) as error:
                # Unconfirmed is not held: retry a transient error (database busy or
                # unreachable, no answer in time) at the next beat until our own view of
                # the lease runs out; give up at once on anything else.
                transient = isinstance(error, TimeoutError) or error.retriable
                log.warning("lease.heartbeat_failed", task_id=str(lease.task_id), error=str(error))
                if not transient or self.monotonic() >= state.deadline:
                    state.lost = True
            except Exception:
                log.exception("lease.heartbeat_crashed", task_id=str(lease.task_id))
                state.lost = True
            if state.lost:
                on_lost()
                return
            now = self.monotonic()
            state.next_beat_at = now + interval
            await asyncio.sleep(interval if until is None else max(0.0, min(interval, until - now)))

    # --- the result -------------------------------------------------------------------------

    async def record(self, attempt: IndexedAttempt) -> RunOnceResult:
        """Write the attempt's result: complete (with the sink's write in its transaction)
        or the retry policy's fail; both fenced, so a lost lease writes nothing. The lease
        is kept beating until the write returns (a completion may wait in the group queue
        longer than a lease), for at most ``completion_max_wait_seconds``. The attempt's
        span ends with it."""
        span = attempt.span
        if span is None:
            return await self._record_beating(attempt)
        try:
            with span.current():
                result = await self._record_beating(attempt)
        except BaseException as error:
            span.end("NOT_RECORDED", error)
            raise
        failed = result is RunOnceResult.FAILED and attempt.failure is not None
        span.end(str(result), attempt.failure.code if failed and attempt.failure else None)
        return result

    async def _record_beating(self, attempt: IndexedAttempt) -> RunOnceResult:
        lease = attempt.lease
        if attempt.lost:
            return self._lost(lease)
        state = attempt.lease_state
        if state is None:
            now = self.monotonic()
            state = _LeaseState(now + self.lease_seconds, now + self.lease_seconds / 3)
        # Nothing to cancel once the work is done: the write's own fence decides, and the
        # queue withdraws a completion still queued when a beat is refused.
        now = self.monotonic()
        first_in = min(self.lease_seconds / 3, state.next_beat_at - now)
        until = now + self.completion_max_wait_seconds
        async with self._beating(lease, state, first_in, on_lost=_nothing, until=until):
            return await self._record(attempt)

    async def _record(self, attempt: IndexedAttempt) -> RunOnceResult:
        lease, context = attempt.lease, attempt.log_context
        failure = attempt.failure
        unknown_outcome = False
        if failure is None:
            outcome = attempt.outcome
            assert outcome is not None
            try:
                # Waiting for a group, and its commit (completions.py): the wait is from
                # this event to the group's span (kb.index.group_commit), not a span itself.
                mark("kb.index.commit_queued")
                await self.queue.complete(lease, in_transaction=outcome.write)
            except LeaseLost:
                return self._lost(lease)
            except DatabaseUnavailable as error:
                # The connection went away, maybe while COMMIT was on its way: the row says
                # whether it landed.
                log.warning("task.complete_outcome_unknown", error=str(error), **context)
                settled = await self._settle_unknown_outcome(lease, context)
                if settled is not None:
                    return settled
                unknown_outcome = True
                failure = AttemptFailure.of(error)
            except Exception as error:
                # The result (or the sink's write in its transaction) was not recorded:
                # the same policy as a failed indexing run, not a silent lease expiry.
                if isinstance(error, KbError):
                    log.warning("task.complete_failed", error=str(error), **context)
                else:
                    log.exception("task.complete_crashed", **context)
                failure = AttemptFailure.of(error)
            else:
                return self._completed(lease, context)
        decision = self.policy.decide(
            lease,
            failure.code,
            failure.message,
            retry_after_seconds=failure.retry_after_seconds,
            retriable=failure.retriable,
            rng=self._rng,
        )
        try:
            failed = await self.queue.fail(lease, decision)
        except LeaseLost:
            if unknown_outcome:
                # The lost COMMIT may have landed after all, behind our fail's row lock.
                settled = await self._settle_unknown_outcome(lease, context)
                if settled is not None:
                    return settled
            return self._lost(lease)
        # The row says where it went: a provider failure whose time budget is spent is DEAD
        # although the decision said RETRY_WAIT (only the fail knows the budget's start).
        log.info(
            "task.failed",
            **context,
            error_code=failure.code,
            next_status=str(failed.status),
            delay_seconds=round(decision.delay_seconds, 3),
            next_attempt_at=failed.next_attempt_at.isoformat(),
        )
        self._emit(WorkerEvent("failed", lease.task_id, f"{failure.code} {failed.status}"))
        return RunOnceResult.FAILED

    async def _settle_unknown_outcome(
        self, lease: Lease, context: dict[str, object]
    ) -> RunOnceResult | None:
        """SUCCEEDED if the row is SUCCEEDED with our generation, LOST_LEASE if the task is
        someone else's (or gone), None while it is still ours to fail."""
        task = await self._reread(lease)
        if task is not None and _succeeded_by(task, lease):
            log.info("task.complete_confirmed", **context)
            return self._completed(lease, context)
        if task is not None and _held_by(task, lease):
            return None
        return self._lost(lease)

    async def _reread(self, lease: Lease) -> IndexTask | None:
        """The task's row, retried with backoff while the database is unreachable, for at
        most one lease period; after that the error propagates (nothing is known)."""
        backoff = Backoff(0.05, max(0.05, self.lease_seconds / 3), 0.5)
        give_up_at = time.monotonic() + self.lease_seconds
        failures = 0
        while True:
            try:
                return await self.queue.get(lease.task_id)
            except KbError as error:
                failures += 1
                pause = backoff.delay(failures, self._rng)
                if not error.retriable or time.monotonic() + pause > give_up_at:
                    raise
                log.warning("task.reread_failed", task_id=str(lease.task_id), error=str(error))
                await asyncio.sleep(pause)

    def _completed(self, lease: Lease, context: dict[str, object]) -> RunOnceResult:
        log.info("task.completed", **context)
        self._emit(WorkerEvent("completed", lease.task_id))
        return RunOnceResult.SUCCEEDED

    def _lost(self, lease: Lease) -> RunOnceResult:
        log.warning(
            "lease.lost",
            task_id=str(lease.task_id),
            lease_attempt=lease.lease_attempt,
            owner=self.owner,
        )
        self._emit(WorkerEvent("lease_lost", lease.task_id))
        return RunOnceResult.LOST_LEASE

    def _context(self, lease: Lease) -> dict[str, object]:
        return {
            "task_id": str(lease.task_id),
            "tenant_id": lease.tenant_id,
            "document_id": str(lease.document_id),
            "version_number": lease.version_number,
            "lease_attempt": lease.lease_attempt,
            "owner": self.owner,
        }


def _nothing() -> None:
    pass


def _succeeded_by(task: IndexTask, lease: Lease) -> bool:
    # `attempts` is the generation: equal means no claim came after ours.
    return (
        task.status is TaskStatus.SUCCEEDED
        and task.attempts == lease.lease_attempt
        and task.lease_owner == lease.owner
    )


def _held_by(task: IndexTask, lease: Lease) -> bool:
    return (
        task.status is TaskStatus.RUNNING
        and task.attempts == lease.lease_attempt
        and task.lease_owner == lease.owner
    )
