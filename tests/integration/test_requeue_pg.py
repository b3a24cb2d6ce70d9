"""The one requeue (queries.sql: requeue_task) on real PostgreSQL, from both of its callers:
`kb tasks requeue` (DEAD -> PENDING) and `kb index check --repair` (SUCCEEDED -> PENDING).
A requeue from a status the task is not in changes nothing at all."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.indexer.maintenance.index_check_pg import RERUN_REASON
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.task import ErrorCode, FailureDecision, InvalidTransition, TaskStatus
from tests.support.clock import ManualClock
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

LEASE = 30.0
DEAD = FailureDecision(TaskStatus.DEAD, ErrorCode.DOCUMENT_PARSE_FAILED, "corrupt", 0.0)
RETRY = FailureDecision(TaskStatus.RETRY_WAIT, ErrorCode.EMBEDDING_TIMEOUT, "slow", 60.0)


async def one_task_in_each_status(
    pool: asyncpg.Pool[Any], queue: PgTaskQueue, clock: ManualClock
) -> dict[TaskStatus, uuid.UUID]:
    """Each task is created and moved on before the next exists, so each claim takes it."""
    tasks: dict[TaskStatus, uuid.UUID] = {}
    for status in (TaskStatus.SUCCEEDED, TaskStatus.RETRY_WAIT, TaskStatus.DEAD):
        created = await create_task(pool, next_attempt_at=clock.now())
        [lease] = await queue.claim("standard", f"w-{status}", lease_seconds=LEASE)
        assert lease.task_id == created.task_id
        if status is TaskStatus.SUCCEEDED:
            await queue.complete(lease)
        else:
            await queue.fail(lease, DEAD if status is TaskStatus.DEAD else RETRY)
        tasks[status] = created.task_id
    running = await create_task(pool, next_attempt_at=clock.now())
    [lease] = await queue.claim("standard", "w-running", lease_seconds=LEASE)
    assert lease.task_id == running.task_id
    tasks[TaskStatus.RUNNING] = running.task_id
    tasks[TaskStatus.PENDING] = (await create_task(pool, next_attempt_at=clock.now())).task_id
    for status, task_id in tasks.items():
        assert await queue_status(queue, task_id) is status
    return tasks


async def queue_status(queue: PgTaskQueue, task_id: uuid.UUID) -> TaskStatus:
    task = await queue.get(task_id)
    assert task is not None
    return task.status


async def every_row(pool: asyncpg.Pool[Any]) -> tuple[list[Any], int]:
    tasks = await pool.fetch("SELECT * FROM index_task ORDER BY task_id")
    audits = await pool.fetchval("SELECT count(*) FROM index_task_requeue")
    return [dict(row) for row in tasks], audits


async def test_a_requeue_from_the_wrong_status_changes_nothing(pool: asyncpg.Pool[Any]) -> None:
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0))
    queue = PgTaskQueue(pool, clock=clock)
    tasks = await one_task_in_each_status(pool, queue, clock)
    before = await every_row(pool)
    assert before[1] == 0
    clock.advance(5)

    for status, task_id in tasks.items():
        for origin in (TaskStatus.DEAD, TaskStatus.SUCCEEDED):
            if origin is not status:
                requeued = await queue.requeue_from(
                    origin, task_id, by="ops", reset_attempts=True, budget=8
                )
                assert requeued is None, (status, origin)
        if status is not TaskStatus.DEAD:
            with pytest.raises(InvalidTransition, match="only DEAD"):
                await queue.requeue(task_id, by="ops", reset_attempts=False, budget=8)
        if status is not TaskStatus.SUCCEEDED:
            rerun = await queue.rerun_succeeded(task_id, by="check", budget=8, reason=RERUN_REASON)
            assert rerun is None
        # A live status is never a status to requeue from, whatever the task's is.
        for live in (TaskStatus.PENDING, TaskStatus.RUNNING, TaskStatus.RETRY_WAIT):
            with pytest.raises(ValueError, match="DEAD or SUCCEEDED"):
                await queue.requeue_from(live, task_id, by="ops", reset_attempts=True, budget=8)

    assert await every_row(pool) == before


async def test_operator_requeue_and_drift_rerun_keep_their_own_terms(
    pool: asyncpg.Pool[Any],
) -> None:
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0))
    queue = PgTaskQueue(pool, clock=clock)
    tasks = await one_task_in_each_status(pool, queue, clock)
    clock.advance(5)

    # DEAD -> PENDING: one more attempt (no reset), the task's own error on record, its
    # last owner still shown until the next claim.
    dead = tasks[TaskStatus.DEAD]
    record = await queue.requeue(dead, by="ops@acme", reset_attempts=False, budget=8)
    assert (record.requeued_by, record.requeued_at, record.reset_attempts) == (
        "ops@acme",
        clock.now(),
        False,
    )
    assert (record.previous_error_code, record.previous_error_message) == (
        ErrorCode.DOCUMENT_PARSE_FAILED,
        "corrupt",
    )
    assert (record.attempts, record.previous_max_attempts, record.new_max_attempts) == (1, 8, 2)
    task = await queue.get(dead)
    assert task is not None
    assert (task.status, task.attempts, task.max_attempts) == (TaskStatus.PENDING, 1, 2)
    assert (task.lease_owner, task.lease_until, task.error_code) == (
        f"w-{TaskStatus.DEAD}",
        None,
        None,
    )
    assert (task.next_attempt_at, task.finished_at) == (clock.now(), None)

    # SUCCEEDED -> PENDING: a full budget, the drift reason on record, no owner.
    done = tasks[TaskStatus.SUCCEEDED]
    rerun = await queue.rerun_succeeded(done, by="kb index check", budget=5, reason=RERUN_REASON)
    assert rerun is not None
    assert (rerun.task_id, rerun.requeued_by, rerun.reset_attempts) == (
        done,
        "kb index check",
        True,
    )
    assert (rerun.previous_error_code, rerun.previous_error_message) == RERUN_REASON
    assert (rerun.attempts, rerun.previous_max_attempts, rerun.new_max_attempts) == (1, 8, 6)
    task = await queue.get(done)
    assert task is not None
    assert (task.status, task.attempts, task.max_attempts) == (TaskStatus.PENDING, 1, 6)
    assert (task.lease_owner, task.lease_until, task.finished_at) == (None, None, None)

    # A second repair of the same task finds it PENDING: nothing more is written.
    assert await queue.rerun_succeeded(done, by="again", budget=5, reason=RERUN_REASON) is None
    assert [r.requeued_by for r in await queue.requeue_history(done)] == ["kb index check"]

    # Both come back as the next generation: the fence never repeats.
    claimed = await queue.claim("standard", "w-next", lease_seconds=LEASE, limit=10)
    generations = {lease.task_id: lease.lease_attempt for lease in claimed}
    assert generations[dead] == 2
    assert generations[done] == 2
