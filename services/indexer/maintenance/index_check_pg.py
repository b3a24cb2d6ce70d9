"""The PostgreSQL side of `kb index check`: read every document's index state in one
snapshot, and carry out the repairs ``index_check`` decides."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from services.indexer.maintenance.index_check import (
    DocumentIndexState,
    Drift,
    RepairAction,
    find_drift,
)
from services.indexer.queue.store_pg import PgTaskQueue
from services.runtime.clock import Clock, DatabaseClock
from services.runtime.db import translate_db_errors
from services.runtime.errors import NotFound
from services.runtime.records import from_row
from services.runtime.sql import queries_beside
from services.runtime.tasks import TASK_TYPE_INDEX_VERSION, TaskStatus, enqueue_index_task

QUERIES = queries_beside(__file__, "index_check.sql")


@dataclass(frozen=True)
class RepairOutcome:
    drift: Drift
    repaired: bool
    task_id: uuid.UUID | None
    note: str


# What a re-run's audit row says in place of the task's error.
RERUN_REASON = ("INDEX_DRIFT", "re-run by kb index check --repair")


class PgIndexCheck:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        clock: Clock | None = None,
        queue: PgTaskQueue | None = None,
    ) -> None:
        self._pool = pool
        self._clock = clock or DatabaseClock()
        # A re-run goes through the queue's one requeue, as `kb tasks requeue` does.
        self._queue = queue or PgTaskQueue(pool, clock=self._clock)

    async def states(self, tenant_id: str | None) -> list[DocumentIndexState]:
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                if tenant_id is not None and not await conn.fetchval(
                    QUERIES["tenant_exists"], tenant_id
                ):
                    raise NotFound(f"no tenant {tenant_id!r}", code="TENANT_NOT_FOUND")
                rows = await conn.fetch(
                    QUERIES["document_index_states"], tenant_id, TASK_TYPE_INDEX_VERSION
                )
        return [_state(row) for row in rows]

    async def drift(self, tenant_id: str | None) -> tuple[int, list[Drift]]:
        """(documents checked, their drifts)."""
        states = await self.states(tenant_id)
        return len(states), [d for state in states for d in find_drift(state)]

    async def repair(self, drift: Drift, *, by: str, budget: int) -> RepairOutcome:
        repair, state = drift.repair, drift.state
        if repair.action is RepairAction.NONE or repair.version_number is None:
            return RepairOutcome(drift, False, repair.task_id, repair.reason)
        if repair.action is RepairAction.ENQUEUE:
            with translate_db_errors():
                async with self._pool.acquire() as conn, conn.transaction():
                    enqueued = await enqueue_index_task(
                        conn,
                        tenant_id=state.tenant_id,
                        document_id=state.document_id,
                        version_number=repair.version_number,
                        tier=state.tier,
                        max_attempts=budget,
                        now=self._clock.now(),
                    )
            note = "task created" if enqueued.created else "a task appeared meanwhile"
            return RepairOutcome(drift, True, enqueued.task_id, note)
        assert repair.task_id is not None  # a RERUN names the task (index_check._rerun)
        rerun = await self._queue.rerun_succeeded(
            repair.task_id, by=by, budget=budget, reason=RERUN_REASON
        )
        if rerun is None:
            return RepairOutcome(drift, False, repair.task_id, "its task is no longer SUCCEEDED")
        return RepairOutcome(drift, True, rerun.task_id, "task back to PENDING")


def _state(row: Mapping[str, Any]) -> DocumentIndexState:
    def status(value: str | None) -> TaskStatus | None:
        return None if value is None else TaskStatus(value)

    return from_row(
        DocumentIndexState,
        row,
        published_task_status=status(row["published_task_status"]),
        served_task_status=status(row["served_task_status"]),
    )
