"""Completions committed as a group (services/indexer/queue/completions.py), on real
PostgreSQL: each task's fence is checked on its own, a lost lease or a failed write drops
that task's writes only, and the others commit with their chunks, pointers and events."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import numpy as np
import pytest

from services.index.generation import IndexGeneration
from services.indexer.ports import InTransaction
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.task import Lease, TaskStatus
from services.indexer.sink.pgvector import PgVectorSink
from services.runtime.errors import LeaseLost
from services.runtime.events import DOCUMENT_SEARCH_VERSION_SWITCHED
from services.runtime.transaction import Transaction
from tests.support import versions
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

DIMENSION = 8
GENERATION = IndexGeneration("test-group-8", DIMENSION, "heading-semchunk-v1:max=256")


class WriteBroke(Exception):
    pass


async def claimed(pool: asyncpg.Pool[Any], queue: PgTaskQueue, count: int) -> list[Lease]:
    for _ in range(count):
        await create_task(pool)
    leases = await queue.claim("standard", "w1", lease_seconds=60, limit=count)
    assert len(leases) == count
    return leases


def write_for(sink: PgVectorSink, lease: Lease) -> InTransaction:
    chunks = versions.make_chunks(
        lease.document_id,
        lease.version_number,
        [f"text of {lease.document_id}"],
        GENERATION.chunking_strategy,
    )
    vectors = np.full((len(chunks), DIMENSION), 1 / np.sqrt(DIMENSION), dtype=np.float32)
    return sink.writer(lease, GENERATION, chunks, vectors)


async def indexed(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> tuple[int, bool, int]:
    """Chunks, whether a pointer exists, and switched events of one document."""
    chunks = await pool.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", document_id
    )
    has_pointer = await pool.fetchval(
        "SELECT EXISTS (SELECT 1 FROM document_search_version WHERE document_id = $1)",
        document_id,
    )
    events = await pool.fetchval(
        "SELECT count(*) FROM outbox WHERE event_type = $1 AND aggregate_key LIKE $2",
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        f"%/{document_id}",
    )
    return chunks, has_pointer, events


async def status(pool: asyncpg.Pool[Any], lease: Lease) -> TaskStatus:
    return TaskStatus(
        await pool.fetchval("SELECT status FROM index_task WHERE task_id = $1", lease.task_id)
    )


async def test_a_lost_lease_in_a_group_writes_nothing_and_the_others_commit(
    pool: asyncpg.Pool[Any],
) -> None:
    groups: list[int] = []
    queue = PgTaskQueue(pool, on_completion_group=groups.append)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    first, stolen, third = await claimed(pool, queue, 3)
    # Another worker took the middle task over: a new owner and lease generation.
    await pool.execute(
        "UPDATE index_task SET lease_owner = 'rescuer', attempts = attempts + 1 WHERE task_id = $1",
        stolen.task_id,
    )
    results = await asyncio.gather(
        *(
            queue.complete(lease, in_transaction=write_for(sink, lease))
            for lease in (first, stolen, third)
        ),
        return_exceptions=True,
    )
    assert groups == [3]  # one transaction for the three
    assert queue.completions.written_as_set == 1  # one set of statements, too
    assert results[0] is None
    assert results[2] is None
    assert isinstance(results[1], LeaseLost)
    for lease in (first, third):
        assert await indexed(pool, lease.document_id) == (1, True, 1)
        assert await status(pool, lease) is TaskStatus.SUCCEEDED
    assert await indexed(pool, stolen.document_id) == (0, False, 0)
    assert await status(pool, stolen) is TaskStatus.RUNNING  # the rescuer's, untouched


async def test_a_failed_write_in_a_group_fails_its_task_only(pool: asyncpg.Pool[Any]) -> None:
    groups: list[int] = []
    queue = PgTaskQueue(pool, on_completion_group=groups.append)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    good, bad = await claimed(pool, queue, 2)
    bad_write = write_for(sink, bad)

    async def breaks_after_writing(conn: Transaction) -> None:
        await bad_write(conn)  # its rows are written, then rolled back with its savepoint
        raise WriteBroke("the sink failed after its statements")

    results = await asyncio.gather(
        queue.complete(good, in_transaction=write_for(sink, good)),
        queue.complete(bad, in_transaction=breaks_after_writing),
        return_exceptions=True,
    )
    assert groups == [2]
    assert results[0] is None
    assert isinstance(results[1], WriteBroke)
    assert await indexed(pool, good.document_id) == (1, True, 1)
    assert await indexed(pool, bad.document_id) == (0, False, 0)
    assert await status(pool, bad) is TaskStatus.RUNNING  # still ours, for the fenced fail


async def test_completions_arriving_during_a_commit_form_the_next_group(
    pool: asyncpg.Pool[Any],
) -> None:
    groups: list[int] = []
    queue = PgTaskQueue(pool, on_completion_group=groups.append)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    leases = await claimed(pool, queue, 4)
    in_commit = asyncio.Event()
    release = asyncio.Event()
    first_write = write_for(sink, leases[0])

    async def held_write(conn: Transaction) -> None:
        in_commit.set()
        await release.wait()
        await first_write(conn)

    first = asyncio.create_task(queue.complete(leases[0], in_transaction=held_write))
    await in_commit.wait()
    rest = [
        asyncio.create_task(queue.complete(lease, in_transaction=write_for(sink, lease)))
        for lease in leases[1:]
    ]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, *rest)
    assert groups == [1, 3]
    for lease in leases:
        assert await indexed(pool, lease.document_id) == (1, True, 1)
