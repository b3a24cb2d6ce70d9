"""A streamed task that ends DEAD takes its staged chunks (knowledge_chunk_stream) with it,
both ways a task ends DEAD: the fenced fail on its last attempt, and the burial of a lease
that expired with the budget spent. Another task's live attempt keeps its rows, and a
requeued task streams again from nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.retry import RetryPolicy
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import ErrorCode, Lease, TaskStatus
from services.runtime.indexing.media_types import MARKDOWN
from tests.integration.test_pipeline_stream_pg import (
    LEASE,
    StallingEmbedder,
    claim,
    expected_rows,
    long_markdown,
    pipeline,
    staged,
    visible,
)
from tests.support.clock import ManualClock
from tests.support.tasks import CreatedTask, create_task

pytestmark = pytest.mark.integration


@dataclass
class Streams:
    pool: asyncpg.Pool[Any]
    clock: ManualClock
    queue: PgTaskQueue
    stalled: list[asyncio.Task[Any]]

    async def task(self, max_attempts: int) -> CreatedTask:
        return await create_task(
            self.pool,
            content=long_markdown(),
            media_type=MARKDOWN,
            max_attempts=max_attempts,
            next_attempt_at=self.clock.now(),
        )

    async def stage_then_stall(self, lease: Lease) -> None:
        """The attempt stages a few slices, then hangs (a worker about to die): its rows
        stay, and it never cleans up. ``cancel_stalled`` ends it as a kill would."""
        stalling = StallingEmbedder(before_stall=6)
        attempt = asyncio.create_task(
            pipeline(self.pool, self.clock, embedder=stalling).index(lease)
        )
        self.stalled.append(attempt)
        await stalling.stalled.wait()
        assert (await staged(self.pool, lease.task_id)).get(lease.lease_attempt, 0) > 0

    async def crashed_attempt(self, task_id: uuid.UUID) -> Lease:
        """The task's next attempt stages a few slices and is killed: its rows stay."""
        lease = await claim(self.queue, task_id, owner="crashed")
        await self.stage_then_stall(lease)
        await self.cancel_stalled()
        return lease

    async def cancel_stalled(self) -> None:
        for attempt in self.stalled:
            attempt.cancel()
        await asyncio.gather(*self.stalled, return_exceptions=True)
        self.stalled.clear()


@pytest.fixture
async def streams(pool: asyncpg.Pool[Any]) -> AsyncIterator[Streams]:
    clock = ManualClock(datetime.now(UTC))
    await PgVectorSink(pool).ensure_generation(pipeline(pool, clock).generation)
    harness = Streams(pool, clock, PgTaskQueue(pool, clock=clock), [])
    try:
        yield harness
    finally:
        await harness.cancel_stalled()


async def status_and_code(queue: PgTaskQueue, task_id: uuid.UUID) -> tuple[TaskStatus, str | None]:
    task = await queue.get(task_id)
    assert task is not None
    return task.status, task.error_code


@pytest.mark.parametrize(
    ("max_attempts", "ends"), [(2, TaskStatus.DEAD), (8, TaskStatus.RETRY_WAIT)]
)
async def test_a_fenced_fail_to_dead_deletes_every_staged_row_of_the_task(
    streams: Streams, max_attempts: int, ends: TaskStatus
) -> None:
    pool, clock, queue = streams.pool, streams.clock, streams.queue
    doomed = await streams.task(max_attempts=max_attempts)
    first = await streams.crashed_attempt(doomed.task_id)
    clock.advance(LEASE + 1)
    last = await claim(queue, doomed.task_id, owner="last")
    assert last.lease_attempt == 2

    # Another task's attempt is live and staging meanwhile.
    other = await streams.task(max_attempts=8)
    live = await claim(queue, other.task_id, owner="live")
    await streams.stage_then_stall(live)
    others_rows = await staged(pool, other.task_id)
    left_over = {first.lease_attempt: 6 * 8}
    assert await staged(pool, doomed.task_id) == left_over

    # The second attempt fails before it streams (the database is busy): with the attempt
    # budget spent the task ends DEAD; with budget left it waits to run again, and that
    # attempt's first slice deletes the leftovers. (A provider failure spends no attempt:
    # its time budget ending DEAD is tests/integration/test_indexer_provider_budget.py.)
    decision = RetryPolicy(jitter=0).decide(last, "DATABASE_BUSY", "busy", retriable=True)
    assert decision.status is ends
    await queue.fail(last, decision)

    assert await status_and_code(queue, doomed.task_id) == (ends, "DATABASE_BUSY")
    assert await staged(pool, doomed.task_id) == ({} if ends is TaskStatus.DEAD else left_over)
    assert await staged(pool, other.task_id) == others_rows
    assert await status_and_code(queue, other.task_id) == (TaskStatus.RUNNING, None)


async def test_a_lease_expiring_with_the_budget_spent_takes_the_staged_rows_with_it(
    streams: Streams,
) -> None:
    pool, clock, queue = streams.pool, streams.clock, streams.queue
    doomed = await streams.task(max_attempts=1)
    only = await streams.crashed_attempt(doomed.task_id)

    # Another task is claimed later: its lease outlives the doomed one's.
    clock.advance(LEASE / 3)
    other = await streams.task(max_attempts=8)
    live = await claim(queue, other.task_id, owner="live")
    await streams.stage_then_stall(live)
    others_rows = await staged(pool, other.task_id)
    assert others_rows.keys() == {live.lease_attempt}
    assert await staged(pool, doomed.task_id) == {only.lease_attempt: 6 * 8}

    clock.advance(LEASE - LEASE / 3 + 1)  # the doomed lease expired, the live one holds
    assert await queue.claim("standard", "sweeper", lease_seconds=LEASE) == []

    assert await status_and_code(queue, doomed.task_id) == (
        TaskStatus.DEAD,
        ErrorCode.LEASE_ATTEMPTS_EXHAUSTED,
    )
    assert await staged(pool, doomed.task_id) == {}
    assert await staged(pool, other.task_id) == others_rows
    assert await status_and_code(queue, other.task_id) == (TaskStatus.RUNNING, None)

    # `kb tasks requeue`: nothing staged is needed; the next attempt streams it all again.
    await streams.cancel_stalled()
    record = await queue.requeue(doomed.task_id, by="ops", reset_attempts=False, budget=8)
    assert record.previous_error_code == ErrorCode.LEASE_ATTEMPTS_EXHAUSTED
    again = await claim(queue, doomed.task_id, owner="again")
    assert again.lease_attempt == 2
    outcome = await pipeline(pool, clock).index(again)
    assert outcome.write is not None
    await queue.complete(again, in_transaction=outcome.write)
    expected = await expected_rows(long_markdown(), doomed)
    assert await visible(pool, doomed.document_id) == (len(expected), 1, 1)
    assert await staged(pool, doomed.task_id) == {}
