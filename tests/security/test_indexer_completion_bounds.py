"""Issue 41 item 5's follow-ups, on real PostgreSQL: what a finished task's lease does while
its completion waits and commits.

- a completion group that fails after a commit longer than a lease (one write raising at
  the end of it) is written again task by task, and the tasks whose fence held in it still
  end SUCCEEDED on their first attempt: the fallback renews the leases the failed group's
  transaction kept from their heartbeats;
- a committer that never commits does not keep the leases of the completions queued behind
  it forever: after the maximum completion wait the attempt stops beating, its completion
  is withdrawn, and another worker takes the task over once the lease lapses; a group that
  finds no connection within the wait fails its tasks instead of waiting on.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from services.index.generation import IndexGeneration
from services.indexer.ports import InTransaction
from services.indexer.queue.attempt import RunOnceResult, WorkerEvent
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease
from services.runtime.errors import DatabaseBusy
from services.runtime.pg.db import create_pool
from services.runtime.pg.transaction import Transaction
from services.runtime.settings import RuntimeSettings
from tests.support.completions import (
    attempts_of,
    database_clock_passes,
    held_and_queued,
    uniform_write,
)
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

DIMENSION = 8
GENERATION = IndexGeneration("test-bounds-8", DIMENSION, "heading-semchunk-v1:max=256")
LEASE_SECONDS = 3.0


def write_for(sink: PgVectorSink, lease: Lease) -> InTransaction:
    return uniform_write(sink, GENERATION, lease)


class SlowThenBroken:
    """A write that holds its group's transaction open until ``release``, then fails as a
    statement timeout would; written again (the group's fallback), it fails at once."""

    def __init__(self, write: InTransaction) -> None:
        self._write = write
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, conn: Transaction) -> None:
        await self._write(conn)
        self.reached.set()
        await self.release.wait()
        raise DatabaseBusy("QueryCanceledError: canceling statement due to statement timeout")


def in_write_order(leases: list[Lease]) -> list[Lease]:
    # The order a group writes its tasks in (completions.py).
    return sorted(
        leases, key=lambda lease: (lease.tenant_id, str(lease.document_id), lease.version_number)
    )


async def task_row(pool: asyncpg.Pool[Any], lease: Lease) -> tuple[str, int, str]:
    row = await pool.fetchrow(
        "SELECT status, attempts, lease_owner FROM index_task WHERE task_id = $1", lease.task_id
    )
    assert row is not None
    return row["status"], row["attempts"], row["lease_owner"]


async def test_a_group_failing_after_a_commit_longer_than_a_lease_keeps_the_others_leases(
    pool: asyncpg.Pool[Any],
) -> None:
    groups: list[int] = []
    queue = PgTaskQueue(pool, committing_groups=1, on_completion_group=groups.append)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    for _ in range(3):
        await create_task(pool)
    leases = await queue.claim("standard", "w1", lease_seconds=LEASE_SECONDS, limit=3)
    # The last write of the group is the slow one that fails: the two before it passed
    # their fence in the group's transaction, and their heartbeats then leave them alone.
    *good, slow = in_write_order(leases)
    broken = SlowThenBroken(write_for(sink, slow))
    writes: dict[uuid.UUID, InTransaction] = {
        lease.task_id: write_for(sink, lease) for lease in good
    }
    writes[slow.task_id] = broken
    events: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    attempts = attempts_of(queue, writes, events, lease_seconds=LEASE_SECONDS)
    running = [asyncio.create_task(attempts.process(lease)) for lease in (*good, slow)]
    try:
        await broken.reached.wait()  # the group is committing, its first two fenced
        assert groups == [3]
        # The group's transaction outlives every lease of the claim.
        await database_clock_passes(
            pool, max(lease.lease_until for lease in leases), events, LEASE_SECONDS / 3
        )
    finally:
        broken.release.set()
        results = await asyncio.gather(*running, return_exceptions=True)
    assert results == [RunOnceResult.SUCCEEDED, RunOnceResult.SUCCEEDED, RunOnceResult.FAILED]
    for lease in good:
        assert await task_row(pool, lease) == ("SUCCEEDED", 1, "w1")
    # The broken one's failure is recorded under its lease, to be retried.
    assert await task_row(pool, slow) == ("RETRY_WAIT", 1, "w1")


async def test_a_committer_that_never_commits_lets_the_queued_leases_go(
    pool: asyncpg.Pool[Any],
) -> None:
    max_wait = LEASE_SECONDS
    # One group commits at a time, and the first never does while the test runs.
    queue = PgTaskQueue(pool, committing_groups=1, completion_max_wait_seconds=max_wait)
    held, queued, paused, events, attempts = await held_and_queued(
        pool, queue, GENERATION, lease_seconds=LEASE_SECONDS, completion_max_wait_seconds=max_wait
    )
    first = asyncio.create_task(attempts.process(held))
    try:
        await paused.reached.wait()
        second = asyncio.create_task(attempts.process(queued))
        # Past the wait the queued completion is withdrawn: the attempt gives the task up.
        # (A bound only so that a regression fails instead of hanging: the wait is 3 s.)
        async with asyncio.timeout(20 * max_wait):
            assert await second is RunOnceResult.LOST_LEASE
        assert not first.done()
        # Its lease is no longer renewed: once it lapses another worker takes the task over.
        lease_until = await pool.fetchval(
            "SELECT lease_until FROM index_task WHERE task_id = $1", queued.task_id
        )
        await database_clock_passes(pool, lease_until, events, LEASE_SECONDS / 3)
        rescued = await queue.claim("standard", "rescuer", lease_seconds=LEASE_SECONDS, limit=2)
        # The task whose group is committing keeps its row locked: not taken over.
        assert [(lease.task_id, lease.lease_attempt) for lease in rescued] == [(queued.task_id, 2)]
    finally:
        paused.release.set()
    # Its fence passed before the wait ran out: the commit decides, and it landed.
    assert await first is RunOnceResult.SUCCEEDED
    assert await task_row(pool, held) == ("SUCCEEDED", 1, "w1")
    assert await task_row(pool, queued) == ("RUNNING", 2, "rescuer")


async def test_a_group_that_finds_no_connection_fails_within_the_wait(
    pool: asyncpg.Pool[Any], settings: RuntimeSettings
) -> None:
    starved = await create_pool(settings, min_size=1, max_size=1)
    try:
        queue = PgTaskQueue(starved, completion_max_wait_seconds=LEASE_SECONDS)
        sink = PgVectorSink(pool)
        await sink.ensure_generation(GENERATION)
        await create_task(pool)
        (lease,) = await queue.claim("standard", "w1", lease_seconds=LEASE_SECONDS, limit=1)
        async with starved.acquire():  # the pool's one connection, kept busy
            with pytest.raises(DatabaseBusy):
                # A bound only so that a regression fails instead of hanging.
                async with asyncio.timeout(20 * LEASE_SECONDS):
                    await queue.complete(lease, in_transaction=write_for(sink, lease))
        # Nothing was written: the task is still ours, to be failed and retried.
        assert await task_row(pool, lease) == ("RUNNING", 1, "w1")
    finally:
        await starved.close()
