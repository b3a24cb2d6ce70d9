"""The PostgreSQL task queue: named queries in ``queries.sql``, one method per query.

Every write is one short statement (``complete`` is one short transaction, with the sink's
work inside it); no transaction or lock is ever held across indexing work.

Heartbeats may run on a pool of their own (``heartbeat_pool``, one or two connections): when
every connection of the main pool is busy claiming and writing results, a heartbeat waiting
for one would let a healthy lease expire. Each heartbeat gives up after a quarter of the
lease (waiting for a connection included), before the next beat is due at a third.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import asyncpg

from services.indexer.ports import InTransaction
from services.indexer.queue.completions import GroupCommitter
from services.indexer.queue.failed import announce_dead
from services.indexer.task import (
    FailureDecision,
    IndexTask,
    InvalidTransition,
    Lease,
    RequeueRecord,
    TaskStatus,
)
from services.runtime.errors import KbError, LeaseLost, NotFound
from services.runtime.indexing.tasks import task_of_row
from services.runtime.logging import get_logger
from services.runtime.messaging.avro import SchemaRegistry, default_registry
from services.runtime.pg.clock import Clock, DatabaseClock
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

QUERIES = queries_beside(__file__, "queries.sql")
log = get_logger(__name__)

# The finished states a task can be put back to PENDING from (``requeue_task``).
_REQUEUED_FROM = frozenset({TaskStatus.DEAD, TaskStatus.SUCCEEDED})


class PgTaskQueue:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        heartbeat_pool: asyncpg.Pool[Any] | None = None,
        clock: Clock | None = None,
        exhausted_per_claim: int = 100,
        min_candidates: int = 32,
        max_completion_group: int = 32,
        committing_groups: int = 1,
        on_completion_group: Callable[[int], None] | None = None,
        completion_max_wait_seconds: float | None = None,
        registry: SchemaRegistry | None = None,
    ) -> None:
        self._pool = pool
        self._registry = registry or default_registry()
        self._heartbeat_pool = heartbeat_pool or pool
        self._clock = clock or DatabaseClock()
        self._exhausted_per_claim = exhausted_per_claim
        self._min_candidates = min_candidates
        # Completions with a write commit in groups (completions.py); 1: each on its own.
        self.completions = GroupCommitter(
            pool,
            self._fence_holds,
            _lost,
            max_group=max_completion_group,
            on_group=on_completion_group,
            fence_all=self._fences_hold,
            committing_groups=committing_groups,
            renew=self._renew_held,
            max_wait_seconds=completion_max_wait_seconds,
        )

    async def claim(
        self, tier: str, owner: str, *, lease_seconds: float, limit: int = 1
    ) -> list[Lease]:
        if limit < 1:
            return []
        # Consider more candidates than we take: concurrent claimers skip each other's
        # locked rows and must still find work in the same statement.
        candidates = max(self._min_candidates, 4 * limit)
        with translate_db_errors():
            rows = await self._pool.fetch(
                QUERIES["claim_tasks"],
                tier,
                owner,
                float(lease_seconds),
                limit,
                candidates,
                self._exhausted_per_claim,
                self._clock.now(),
            )
        exhausted = [row["task_id"] for row in rows if row["exhausted"]]
        if exhausted:
            await self._bury(tier, exhausted)
        return [_lease(row) for row in rows if not row["exhausted"]]

    async def _bury(self, tier: str, exhausted: list[uuid.UUID]) -> None:
        """Ends the exhausted leases the claim found DEAD, each with its event. A failure
        here must not cost the leases just claimed: the tasks stay exhausted and the next
        claim buries them."""
        try:
            await self._announcing_dead(
                "bury_exhausted", exhausted, self._clock.now(), row_trace=True
            )
        except KbError as error:
            log.warning("tasks.bury_failed", tier=tier, tasks=len(exhausted), error_code=error.code)

    async def _announcing_dead(self, query: str, *args: object, row_trace: bool) -> list[Any]:
        """Runs ``query``, which may end tasks DEAD, and writes the DocumentIndexingFailed
        of each in its transaction (failed.py): its rows."""
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                rows = await conn.fetch(QUERIES[query], *args)
                await announce_dead(conn, rows, self._registry, row_trace=row_trace)
        return rows

    async def heartbeat(self, lease: Lease, *, lease_seconds: float) -> Lease:
        if self.completions.fenced(lease):
            # Our own group transaction holds the row (the completion's fence passed): no
            # takeover can come before it ends, and a beat would only wait for its lock.
            return lease
        # A timed-out beat (DatabaseUnavailable) ends before the next one is due.
        budget = lease_seconds / 4
        deadline = time.monotonic() + budget
        with translate_db_errors():
            async with self._heartbeat_pool.acquire(timeout=budget) as conn:
                lease_until = await conn.fetchval(
                    QUERIES["heartbeat"],
                    lease.task_id,
                    lease.owner,
                    lease.lease_attempt,
                    float(lease_seconds),
                    self._clock.now(),
                    timeout=max(0.001, deadline - time.monotonic()),
                )
        if lease_until is None:
            lost = _lost(lease)
            # A completion of this lease still waiting for a group can never pass its
            # fence: it goes now rather than after the groups ahead of it.
            self.completions.withdraw(lease, lost)
            raise lost
        return replace(lease, lease_until=lease_until)

    async def complete(self, lease: Lease, *, in_transaction: InTransaction | None = None) -> None:
        if in_transaction is None:
            # Nothing to write with it: one autocommitted statement, one round trip.
            with translate_db_errors():
                if not await self._fence_holds(self._pool, lease):
                    raise _lost(lease)
            return
        await self.completions.complete(lease, in_transaction)

    async def _fence_holds(self, conn: Transaction | asyncpg.Pool[Any], lease: Lease) -> bool:
        """Completes the task if the lease still holds (the fence); whether it did."""
        return bool(await self._fences_hold(conn, [lease]))

    async def _fences_hold(
        self, conn: Transaction | asyncpg.Pool[Any], leases: Sequence[Lease]
    ) -> set[uuid.UUID]:
        """``_fence_holds`` for several tasks in one statement: the tasks it completed."""
        rows = await conn.fetch(
            QUERIES["complete_task"],
            [lease.task_id for lease in leases],
            [lease.owner for lease in leases],
            [lease.lease_attempt for lease in leases],
            self._clock.now(),
        )
        return {row["task_id"] for row in rows}

    async def _renew_held(
        self, conn: Transaction, leases: Sequence[Lease], held: set[uuid.UUID]
    ) -> set[uuid.UUID]:
        """Locks the rows of ``leases`` still ours and renews the leases of ``held``: the
        rows it locked (queries.sql: renew_held_leases)."""
        rows = await conn.fetch(
            QUERIES["renew_held_leases"],
            [lease.task_id for lease in leases],
            [lease.owner for lease in leases],
            [lease.lease_attempt for lease in leases],
            list(held),
            self._clock.now(),
        )
        return {row["task_id"] for row in rows}

    async def fail(self, lease: Lease, decision: FailureDecision) -> IndexTask:
        rows = await self._announcing_dead(
            "fail_task",
            lease.task_id,
            lease.owner,
            lease.lease_attempt,
            str(decision.status),
            float(decision.delay_seconds),
            decision.error_code,
            decision.error_message,
            self._clock.now(),
            decision.provider_failure,
            decision.provider_budget_seconds,
            decision.budget_spent_message,
            row_trace=False,
        )
        if not rows:
            raise _lost(lease)
        return task_from_row(rows[0])

    async def get(self, task_id: uuid.UUID) -> IndexTask | None:
        with translate_db_errors():
            row = await self._pool.fetchrow(QUERIES["get_task"], task_id)
        return None if row is None else task_from_row(row)

    async def list_tasks(
        self,
        *,
        status: TaskStatus | None = None,
        tenant_id: str | None = None,
        tier: str | None = None,
        limit: int = 100,
    ) -> list[IndexTask]:
        with translate_db_errors():
            rows = await self._pool.fetch(
                QUERIES["list_tasks"],
                None if status is None else str(status),
                tenant_id,
                tier,
                limit,
            )
        return [task_from_row(row) for row in rows]

    async def requeue(
        self, task_id: uuid.UUID, *, by: str, reset_attempts: bool, budget: int
    ) -> RequeueRecord:
        record = await self.requeue_from(
            TaskStatus.DEAD, task_id, by=by, reset_attempts=reset_attempts, budget=budget
        )
        if record is None:
            current = await self.get(task_id)
            if current is None:
                raise NotFound(f"no index task {task_id}", code="TASK_NOT_FOUND")
            raise InvalidTransition(
                f"task {task_id} is {current.status}; only DEAD tasks can be requeued"
            )
        return record

    async def rerun_succeeded(
        self, task_id: uuid.UUID, *, by: str, budget: int, reason: tuple[str, str]
    ) -> RequeueRecord | None:
        """Drift repair (`kb index check --repair`): a SUCCEEDED task back to PENDING with a
        fresh budget of ``budget`` attempts, audited beside the operators' requeues with
        ``reason`` (code, message) in place of an error. ``None`` when the task is not
        SUCCEEDED (any more): nothing changed."""
        return await self.requeue_from(
            TaskStatus.SUCCEEDED, task_id, by=by, reset_attempts=True, budget=budget, reason=reason
        )

    async def requeue_from(
        self,
        status: TaskStatus,
        task_id: uuid.UUID,
        *,
        by: str,
        reset_attempts: bool,
        budget: int,
        reason: tuple[str, str] | None = None,
    ) -> RequeueRecord | None:
        """The one requeue: the task back to PENDING if it is ``status`` (DEAD or
        SUCCEEDED), its generation kept, audited; ``None`` (nothing changed) otherwise."""
        if status not in _REQUEUED_FROM:
            raise ValueError(f"a task is requeued from DEAD or SUCCEEDED, not {status}")
        code, message = reason if reason is not None else (None, None)
        with translate_db_errors():
            row = await self._pool.fetchrow(
                QUERIES["requeue_task"],
                task_id,
                str(status),
                by,
                reset_attempts,
                budget,
                code,
                message,
                self._clock.now(),
            )
        return None if row is None else _requeue_record(row)

    async def requeue_history(self, task_id: uuid.UUID) -> list[RequeueRecord]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["requeue_history"], task_id)
        return [_requeue_record(row) for row in rows]


def _requeue_record(row: Mapping[str, Any]) -> RequeueRecord:
    return from_row(RequeueRecord, row)


def _lost(lease: Lease) -> LeaseLost:
    return LeaseLost(
        f"task {lease.task_id}: lease {lease.lease_attempt} of {lease.owner} no longer holds"
    )


def _lease(row: Mapping[str, Any]) -> Lease:
    return from_row(Lease, row, owner=row["lease_owner"])


def task_from_row(row: Mapping[str, Any]) -> IndexTask:
    return task_of_row(IndexTask, row)
