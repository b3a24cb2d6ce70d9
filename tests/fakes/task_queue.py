"""An in-memory ``TaskQueue`` for unit tests of the worker. It applies the transitions of
:mod:`services.indexer.task` and :mod:`services.indexer.retry` (the provider failure time
budget included: ``fail`` settles it as ``fail_task`` does in SQL, with this queue's clock)
and the claim order of ``services/indexer/queue/queries.sql`` (expired leases first, then
rounds across tenants), and passes the same contract suite as
``PgTaskQueue`` (tests/contract/test_task_queue_contract.py).

Single event loop, no awaits inside a state change: each method is atomic, as each SQL
statement is.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from services.indexer import task as model
from services.indexer.ports import InTransaction
from services.indexer.task import FailureDecision, IndexTask, Lease, RequeueRecord, TaskStatus
from services.runtime.errors import LeaseLost, NotFound
from services.runtime.pg.clock import Clock, DatabaseClock


class InMemoryTransaction:
    """What ``in_transaction`` receives from the fake: a ``Transaction`` that records every
    statement (and anything a test appends) in ``writes``, committed with the task or not
    at all. Queries answer nothing."""

    def __init__(self) -> None:
        self.writes: list[object] = []

    def is_in_transaction(self) -> bool:
        return True

    async def execute(self, query: str, *args: object) -> str:
        self.writes.append((query, args))
        return "OK"

    async def executemany(self, command: str, args: Iterable[Sequence[object]]) -> None:
        self.writes.extend((command, tuple(row)) for row in args)

    async def fetch(self, query: str, *args: object) -> list[Any]:
        self.writes.append((query, args))
        return []

    async def fetchrow(self, query: str, *args: object) -> Any:
        self.writes.append((query, args))
        return None

    async def fetchval(self, query: str, *args: object, column: int = 0) -> Any:
        self.writes.append((query, args))
        return None

    async def copy_records_to_table(
        self,
        table_name: str,
        *,
        records: Iterable[Sequence[object]] | AsyncIterable[Sequence[object]],
        columns: Iterable[str] | None = None,
        schema_name: str | None = None,
    ) -> str:
        if isinstance(records, AsyncIterable):
            rows = [tuple(row) async for row in records]
        else:
            rows = [tuple(row) for row in records]
        self.writes.append((table_name, rows))
        return f"COPY {len(rows)}"


class InMemoryTaskQueue:
    def __init__(self, clock: Clock | None = None, *, exhausted_per_claim: int = 100) -> None:
        self._clock = clock or DatabaseClock()
        self._tasks: dict[uuid.UUID, IndexTask] = {}
        self._exhausted_per_claim = exhausted_per_claim
        self._turn = 0
        self.requeues: list[RequeueRecord] = []
        self.committed_writes: list[object] = []

    def now(self) -> datetime:
        return self._clock.now() or datetime.now(UTC)

    def add(self, task: IndexTask) -> None:
        self._tasks[task.task_id] = task

    def new_task(
        self,
        *,
        tenant_id: str = "acme",
        tier: str = "standard",
        max_attempts: int = 8,
        next_attempt_at: datetime | None = None,
    ) -> IndexTask:
        now = self.now()
        created = IndexTask(
            task_id=uuid.uuid4(),
            tenant_id=tenant_id,
            document_id=uuid.uuid4(),
            version_number=1,
            task_type=model.TASK_TYPE_INDEX_VERSION,
            tier=tier,
            status=TaskStatus.PENDING,
            attempts=0,
            max_attempts=max_attempts,
            lease_owner=None,
            lease_until=None,
            next_attempt_at=next_attempt_at or now,
            error_code=None,
            error_message=None,
            created_at=now,
            updated_at=now,
            finished_at=None,
        )
        self.add(created)
        return created

    async def claim(
        self, tier: str, owner: str, *, lease_seconds: float, limit: int = 1
    ) -> list[Lease]:
        # The order of queries.sql/claim_tasks: round 0 = expired leases with budget left;
        # a tenant's k-th due task is in round k + its RUNNING count; within a round,
        # tenants take turns from a counter that every claim advances.
        now = self.now()
        self._turn += 1
        in_tier = [t for t in self._tasks.values() if t.tier == tier]
        running: dict[str, int] = defaultdict(int)
        for held in in_tier:
            if held.status is TaskStatus.RUNNING:
                running[held.tenant_id] += 1
        for exhausted in [t for t in in_tier if t.is_exhausted(now)][: self._exhausted_per_claim]:
            self._tasks[exhausted.task_id] = model.mark_exhausted(exhausted, now)
        # T counts tenants with *due* queued work only, as in queries.sql.
        queued_statuses = (TaskStatus.PENDING, TaskStatus.RETRY_WAIT)
        tenants = sorted(
            {t.tenant_id for t in in_tier if t.status in queued_statuses and t.is_due(now)}
        )
        position = {
            tenant: (rank + self._turn) % len(tenants)
            for rank, tenant in enumerate(tenants, start=1)
        }
        order: list[tuple[int, int, datetime, str, IndexTask]] = []
        by_tenant: dict[str, list[IndexTask]] = defaultdict(list)
        for candidate in in_tier:
            current = self._tasks[candidate.task_id]
            if not current.is_due(now):
                continue
            if current.status is TaskStatus.RUNNING:
                assert current.lease_until is not None
                order.append((0, 0, current.lease_until, str(current.task_id), current))
            else:
                by_tenant[current.tenant_id].append(current)
        for tenant, tasks in by_tenant.items():
            # A tenant's publishes (priority 0) before its backfills, as claim_tasks does.
            tasks.sort(key=lambda t: (t.priority, t.next_attempt_at, str(t.task_id)))
            for k, queued in enumerate(tasks, start=1):
                order.append(
                    (
                        k + running[tenant],
                        position[tenant],
                        queued.next_attempt_at,
                        str(queued.task_id),
                        queued,
                    )
                )
        order.sort(key=lambda entry: entry[:4])
        leases: list[Lease] = []
        for *_, chosen in order[:limit]:
            claimed = model.claim(chosen, owner, now, lease_seconds)
            self._tasks[claimed.task_id] = claimed
            leases.append(model.lease_of(claimed))
        return leases

    async def heartbeat(self, lease: Lease, *, lease_seconds: float) -> Lease:
        current = self._fenced(lease)
        beaten = model.heartbeat(current, lease, self.now(), lease_seconds)
        self._tasks[beaten.task_id] = beaten
        assert beaten.lease_until is not None
        return replace(lease, lease_until=beaten.lease_until)

    async def complete(self, lease: Lease, *, in_transaction: InTransaction | None = None) -> None:
        now = self.now()
        current = self._fenced(lease)
        done = model.complete(current, lease, now)  # raises LeaseLost before any write
        transaction = InMemoryTransaction()
        if in_transaction is not None:
            await in_transaction(transaction)
        # Commit: the task and the sink's writes together, or (on an exception) neither.
        self._tasks[done.task_id] = done
        self.committed_writes.extend(transaction.writes)

    async def fail(self, lease: Lease, decision: FailureDecision) -> IndexTask:
        failed = model.fail(self._fenced(lease), lease, decision, self.now())
        self._tasks[failed.task_id] = failed
        return failed

    async def get(self, task_id: uuid.UUID) -> IndexTask | None:
        return self._tasks.get(task_id)

    async def list_tasks(
        self,
        *,
        status: TaskStatus | None = None,
        tenant_id: str | None = None,
        tier: str | None = None,
        limit: int = 100,
    ) -> list[IndexTask]:
        found = [
            t
            for t in self._tasks.values()
            if (status is None or t.status is status)
            and (tenant_id is None or t.tenant_id == tenant_id)
            and (tier is None or t.tier == tier)
        ]
        found.sort(key=lambda t: (-t.updated_at.timestamp(), str(t.task_id)))
        return found[:limit]

    async def requeue(
        self, task_id: uuid.UUID, *, by: str, reset_attempts: bool, budget: int
    ) -> RequeueRecord:
        current = self._tasks.get(task_id)
        if current is None:
            raise NotFound(f"no index task {task_id}", code="TASK_NOT_FOUND")
        requeued, record = model.requeue(
            current, by=by, now=self.now(), reset_attempts=reset_attempts, budget=budget
        )
        self._tasks[task_id] = requeued
        self.requeues.append(record)
        return record

    async def requeue_history(self, task_id: uuid.UUID) -> list[RequeueRecord]:
        return [r for r in self.requeues if r.task_id == task_id]

    def _fenced(self, lease: Lease) -> IndexTask:
        current = self._tasks.get(lease.task_id)
        if current is None:
            raise LeaseLost(f"task {lease.task_id} does not exist (any more)")
        return current
