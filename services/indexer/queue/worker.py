"""The claim loop: keep ``concurrency`` slots indexing claimed tasks
(docs/architecture.md#index-tasks).

``run_once`` does one task; ``Worker.run`` keeps ``concurrency`` slots busy, polls on a timer
with jittered idle backoff, wakes early on ``wake()`` (the hook for Kafka hints) and on
``stop`` finishes running tasks within the grace period. One task's attempt -- indexing
under a heartbeat, then the fenced write of its result -- is :mod:`services.indexer.queue.attempt`.

A failed claim never ends ``run`` (only a configuration error does): the loop logs it and
tries again after a jittered, capped backoff.

A ``ClaimGate`` (the embedding provider's guard), if given, is asked before each claim: while
it allows none (the provider's breaker open, its quota paused) the worker claims nothing --
due tasks stay due and spend no attempt -- and asks again after the wait it suggests (at most
the poll interval; ``stop`` ends the wait, a hint does not); a limit caps the claim (one task
for a breaker's probe). Tasks already running go on, heartbeats included. A gate that fails
(its database unreachable) is logged and the claim goes ahead as if allowed: the claim meets
the same trouble and backs off, or it does not and the work goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.indexer.ports import ClaimAllowance, ClaimGate, DocumentVersionIndexer, TaskQueue
from services.indexer.queue.attempt import IndexedAttempt, TaskAttempts
from services.indexer.queue.attempt import RunOnceResult as RunOnceResult
from services.indexer.queue.attempt import WorkerEvent as WorkerEvent
from services.indexer.queue.attempt_span import Claimed, HintContexts, claimed_now
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, Lease
from services.runtime.backoff import Backoff
from services.runtime.errors import ConfigError, KbError
from services.runtime.identity import owner_id
from services.runtime.logging import get_logger

log = get_logger(__name__)


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
        observer: Callable[[WorkerEvent], None] | None = None,
        rng: random.Random | None = None,
        gate: ClaimGate | None = None,
        completion_max_wait_seconds: float | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.queue = queue
        self.tier = tier
        self.owner = owner or owner_id()
        self.lease_seconds = lease_seconds
        self.concurrency = concurrency
        self.poll_interval_seconds = poll_interval_seconds
        self.idle_backoff_min_seconds = min(idle_backoff_min_seconds, poll_interval_seconds)
        self.grace_period_seconds = grace_period_seconds
        # After the n-th failed claim in a row: doubling from the idle backoff, capped at
        # the poll interval, shortened by up to half at random.
        self.claim_backoff = Backoff(self.idle_backoff_min_seconds, poll_interval_seconds, 0.5)
        self._signals = signals
        self._observer = observer
        self._rng = rng or random.Random()
        self.attempts = TaskAttempts(
            queue,
            indexer,
            owner=self.owner,
            lease_seconds=lease_seconds,
            policy=policy or RetryPolicy(),
            rng=self._rng,
            emit=self._emit,
            completion_max_wait_seconds=completion_max_wait_seconds,
        )
        self.gate = gate
        self._gated_by: str | None = None  # the reason of the gate's last refusal, logged once
        self._wake = asyncio.Event()
        self._wake_waiter: asyncio.Task[bool] | None = None
        # The trace contexts of the hints read (hints.py): an attempt links to its task's.
        self.hint_contexts = HintContexts()

    # --- one task ---------------------------------------------------------------------------

    async def run_once(self) -> RunOnceResult:
        """Claim one task of the tier and see it through; IDLE when nothing is due (or the
        gate allows no claim now)."""
        limit, _ = await self._allowed(1)
        if limit == 0:
            return RunOnceResult.IDLE
        claimed = claimed_now()
        leases = await self.queue.claim(
            self.tier, self.owner, lease_seconds=self.lease_seconds, limit=1
        )
        if not leases:
            self._emit(WorkerEvent("idle"))
            return RunOnceResult.IDLE
        return await self.attempts.process(leases[0], self._claimed(claimed, leases[0]))

    async def process(self, lease: Lease) -> RunOnceResult:
        """Index a claimed task under its lease and record the result (fenced)."""
        return await self.attempts.process(lease)

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
        lease expires, and it is done again (at-least-once, fenced writes:
        docs/architecture.md#leases-and-fencing)."""
        slots: set[asyncio.Task[IndexedAttempt]] = set()
        writes: set[asyncio.Task[RunOnceResult]] = set()
        idle_delay = self.idle_backoff_min_seconds
        failed_claims = 0
        claim_again_at = 0.0  # monotonic; after a failed or gated claim, none before then
        stop_waiter = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                free = self.concurrency - len(slots)
                if len(writes) > self.concurrency:
                    free = 0
                resting = claim_again_at - time.monotonic()
                if free > 0 and resting > 0:
                    # A claim failed or the gate said wait: neither a freed slot nor a
                    # wake-up shortens the pause.
                    slots, writes = await self._wait(
                        slots, writes, stop_waiter, resting, wakeable=False
                    )
                    continue
                claimed = 0
                if free > 0:
                    free, gate_pause = await self._allowed(free)
                    if free == 0:
                        claim_again_at = time.monotonic() + gate_pause
                        continue
                    claim = claimed_now()
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
                        indexing = self.attempts.index(lease, self._claimed(claim, lease))
                        slots.add(asyncio.create_task(indexing))
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

    async def _allowed(self, free: int) -> tuple[int, float]:
        """How many of ``free`` slots may claim now, and (when none may) how long to wait
        before asking the gate again: its hint, at least the idle backoff, at most the poll
        interval."""
        if self.gate is None:
            return free, 0.0
        try:
            allowance: ClaimAllowance = await self.gate.claim_allowance(self.owner)
        except Exception as error:
            # Claim as if allowed: the claim meets the same trouble and backs off, or the
            # work goes on (a gate is a brake, not a dependency).
            fields = {"error": str(error), "owner": self.owner}
            if isinstance(error, KbError):
                log.warning("worker.gate_failed", error_code=error.code, **fields)
            else:
                log.exception("worker.gate_failed", **fields)  # a bug: keep its traceback
            return free, 0.0
        if allowance.limit is None or allowance.limit > 0:
            if self._gated_by is not None:
                log.info("worker.ungated", owner=self.owner, was=self._gated_by)
                self._gated_by = None
            return free if allowance.limit is None else min(free, allowance.limit), 0.0
        hint = allowance.retry_in_seconds
        pause = self.poll_interval_seconds if hint is None else hint
        pause = min(self.poll_interval_seconds, max(self.idle_backoff_min_seconds, pause))
        reason = allowance.reason or "gated"
        if reason != self._gated_by:
            # Once per change of reason, not on every loop.
            log.info(
                "worker.gated",
                owner=self.owner,
                reason=reason,
                retry_in_seconds=None if hint is None else round(hint, 3),
            )
            self._gated_by = reason
        self._emit(WorkerEvent("gated", detail=reason, seconds=pause))
        return 0, pause

    def _claimed(self, claim: Claimed, lease: Lease) -> Claimed:
        """The claim that took ``lease``, with the hint that named its task, if one did."""
        return replace(claim, hint=self.hint_contexts.take(str(lease.task_id)))

    def _claim_backoff(self, failures: int) -> float:
        """Pause after the ``failures``-th failed claim in a row."""
        return self.claim_backoff.delay(failures, self._rng)

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
        slots: set[asyncio.Task[IndexedAttempt]],
        writes: set[asyncio.Task[RunOnceResult]],
        stop_waiter: asyncio.Task[bool],
        wait_seconds: float | None,
        *,
        wakeable: bool = True,
    ) -> tuple[set[asyncio.Task[IndexedAttempt]], set[asyncio.Task[RunOnceResult]]]:
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
        self, slots: set[asyncio.Task[IndexedAttempt]], writes: set[asyncio.Task[RunOnceResult]]
    ) -> tuple[set[asyncio.Task[IndexedAttempt]], set[asyncio.Task[RunOnceResult]]]:
        still_indexing = {t for t in slots if not t.done()}
        still_writing = {t for t in writes if not t.done()}
        for written in writes - still_writing:
            self._reap(written)
        for indexed in slots - still_indexing:
            if indexed.cancelled():
                continue
            error = indexed.exception()
            if error is not None:  # index() catches everything but cancellation: a bug
                log.error("task.indexing_crashed", error=repr(error))
                continue
            still_writing.add(asyncio.create_task(self.attempts.record(indexed.result())))
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
        self, slots: set[asyncio.Task[IndexedAttempt]], writes: set[asyncio.Task[RunOnceResult]]
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
        if self._observer is not None:
            self._observer(event)
