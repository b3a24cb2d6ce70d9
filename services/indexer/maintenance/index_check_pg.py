"""The PostgreSQL side of `kb index check`: read every document's index state in one
snapshot, and what every deleted document still holds, carry out the repairs
``index_check`` decides, and wait for their tasks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

import asyncpg

from services.indexer.maintenance.index_check import (
    IN_PLACE,
    DocumentIndexState,
    Drift,
    RepairAction,
    find_drift,
    find_leftover_drift,
    is_finished,
)
from services.indexer.queue.store_pg import PgTaskQueue
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.errors import NotFound
from services.runtime.indexing.tasks import TASK_TYPE_INDEX_VERSION, TaskStatus, enqueue_index_task
from services.runtime.pg.clock import Clock, DatabaseClock
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "index_check.sql")


@dataclass(frozen=True)
class RepairOutcome:
    drift: Drift
    queued: bool  # a task was put in motion (created, or back to PENDING)
    task_id: uuid.UUID | None
    note: str


# How often the wait for repair tasks reads their status: soon at first (a short document is
# indexed in well under a second), then at most this far apart.
_FIRST_POLL_SECONDS: Final = 0.05
_MAX_POLL_SECONDS: Final = 1.0


# What a re-run's audit row says in place of the task's error.
RERUN_REASON = ("INDEX_DRIFT", "re-run by kb index check --repair")


class PgIndexCheck:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        clock: Clock | None = None,
        queue: PgTaskQueue | None = None,
        batch_rows: int = 5000,
    ) -> None:
        self._pool = pool
        self._clock = clock or DatabaseClock()
        # A re-run goes through the queue's one requeue, as `kb tasks requeue` does.
        self._queue = queue or PgTaskQueue(pool, clock=self._clock)
        # A deleted document's leftovers go by the erase's own statements, in batches of at
        # most this many rows (KB_INDEX_GC_BATCH_ROWS, as the collector's).
        self._erasure = PgErasureStore(pool)
        self._batch_rows = batch_rows
        # The deleted documents whose leftovers this run removed: one removal serves all of
        # a document's drifts.
        self._cleaned: set[tuple[str, uuid.UUID]] = set()

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
        """(documents checked, their drifts): the live documents', then the deleted ones'."""
        states = await self.states(tenant_id)
        drifts = [d for state in states for d in find_drift(state)]
        leftovers = await self._erasure.leftovers(tenant_id, batch_rows=self._batch_rows)
        drifts += [d for left in leftovers for d in find_leftover_drift(left)]
        return len(states) + len(leftovers), drifts

    async def repair(self, drift: Drift, *, by: str, budget: int) -> RepairOutcome:
        repair, state = drift.repair, drift.state
        if repair.action in IN_PLACE:
            return await self._remove(drift)
        if repair.action is RepairAction.NONE or repair.version_number is None:
            return RepairOutcome(drift, False, repair.task_id, repair.reason)
        assert isinstance(state, DocumentIndexState)  # a task repair is a live document's
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

    async def _remove(self, drift: Drift) -> RepairOutcome:
        """A deleted document's pointer tombstoned and its leftovers removed, once per run;
        when its erase was asked for, the erase run again to its end (which sets
        ``erased_at`` only once everything it removes is gone)."""
        key = (drift.state.tenant_id, drift.state.document_id)
        if key in self._cleaned:
            return RepairOutcome(drift, True, None, "removed with the document's other drift")
        tenant_id, document_id = key
        removed = await self._erasure.remove_deleted_leftovers(
            tenant_id, document_id, batch_rows=self._batch_rows, now=self._clock.now()
        )
        note = "removed: " + ", ".join(f"{step} {n}" for step, n in removed.items())
        if drift.repair.action is RepairAction.ERASE:
            await self._erasure.erase_content(
                tenant_id, document_id, batch_rows=self._batch_rows, now=self._clock.now()
            )
            note += "; erase finished"
        self._cleaned.add(key)
        return RepairOutcome(drift, True, None, note)

    async def task_statuses(
        self, task_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, TaskStatus | None]:
        """Each task's status; ``None`` for one that does not exist."""
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["task_statuses"], list(task_ids))
        found = {row["task_id"]: TaskStatus(row["status"]) for row in rows}
        return {task_id: found.get(task_id) for task_id in task_ids}

    async def wait_for_tasks(
        self, task_ids: Collection[uuid.UUID], *, timeout_seconds: float
    ) -> dict[uuid.UUID, TaskStatus | None]:
        """The tasks' statuses once every one has ended (SUCCEEDED or DEAD), or as they are
        when ``timeout_seconds`` have passed. The indexers run them: this only reads."""
        deadline = time.monotonic() + timeout_seconds
        pause = _FIRST_POLL_SECONDS
        while True:
            statuses = await self.task_statuses(task_ids)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or all(is_finished(s) for s in statuses.values()):
                return statuses
            await asyncio.sleep(min(pause, remaining))
            pause = min(pause * 2, _MAX_POLL_SECONDS)


def _state(row: Mapping[str, Any]) -> DocumentIndexState:
    def status(value: str | None) -> TaskStatus | None:
        return None if value is None else TaskStatus(value)

    def code(value: str | None) -> dict[str, str] | None:
        return None if value is None else dict(json.loads(value))

    return from_row(
        DocumentIndexState,
        row,
        published_task_status=status(row["published_task_status"]),
        served_task_status=status(row["served_task_status"]),
        served_code=code(row["served_code"]),
        current_code=code(row["current_code"]),
    )
