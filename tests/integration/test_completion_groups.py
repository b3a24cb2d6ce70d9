"""Completions committed as a group (services/indexer/queue/completions.py), on real
PostgreSQL: each task's fence is checked on its own, a lost lease or a failed write drops
that task's writes only, and the others commit with their chunks, pointers and events."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from services.index.generation import IndexGeneration
from services.indexer.ports import InTransaction
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease, TaskStatus
from services.runtime.errors import LeaseLost
from services.runtime.messaging.events import DOCUMENT_SEARCH_VERSION_SWITCHED
from services.runtime.pg.transaction import Transaction
from tests.support import versions
from tests.support.completions import uniform_write
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.paused import PausedWrite
from tests.support.tasks import create_task
from tests.support.tracing import linked_span_ids, named, one, parent_id, span_id, trace_id, traced

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
    return uniform_write(sink, GENERATION, lease)


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


async def grouped(
    pool: asyncpg.Pool[Any], committing_groups: int = 1
) -> tuple[list[int], PgTaskQueue, PgVectorSink]:
    """A queue that records the size of each completion group it commits, and a sink ready
    for the generation."""
    groups: list[int] = []
    queue = PgTaskQueue(
        pool, on_completion_group=groups.append, committing_groups=committing_groups
    )
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    return groups, queue, sink


async def test_a_lost_lease_in_a_group_writes_nothing_and_the_others_commit(
    pool: asyncpg.Pool[Any],
) -> None:
    groups, queue, sink = await grouped(pool)
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
    groups, queue, sink = await grouped(pool)
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
    groups, queue, sink = await grouped(pool)
    leases = await claimed(pool, queue, 4)
    held = PausedWrite(write_for(sink, leases[0]), before_write=True)
    first = asyncio.create_task(queue.complete(leases[0], in_transaction=held))
    await held.reached.wait()
    rest = [
        asyncio.create_task(queue.complete(lease, in_transaction=write_for(sink, lease)))
        for lease in leases[1:]
    ]
    await asyncio.sleep(0)
    held.release.set()
    await asyncio.gather(first, *rest)
    assert groups == [1, 3]
    for lease in leases:
        assert await indexed(pool, lease.document_id) == (1, True, 1)


async def test_with_two_committing_groups_a_held_commit_does_not_hold_the_next(
    pool: asyncpg.Pool[Any],
) -> None:
    groups, queue, sink = await grouped(pool, committing_groups=2)
    held, second, third = await claimed(pool, queue, 3)
    paused = PausedWrite(write_for(sink, held), before_write=True)
    first = asyncio.create_task(queue.complete(held, in_transaction=paused))
    await paused.reached.wait()
    # The first group is inside its transaction; the second commits beside it.
    await asyncio.wait_for(queue.complete(second, in_transaction=write_for(sink, second)), 60)
    assert not first.done()
    assert await indexed(pool, second.document_id) == (1, True, 1)
    assert await indexed(pool, held.document_id) == (0, False, 0)
    paused.release.set()
    await first
    await queue.complete(third, in_transaction=write_for(sink, third))
    assert groups == [1, 1, 1]
    for lease in (held, second, third):
        assert await indexed(pool, lease.document_id) == (1, True, 1)
        assert await status(pool, lease) is TaskStatus.SUCCEEDED


async def test_two_versions_of_a_document_in_groups_committing_at_once_end_on_the_newer(
    pool: asyncpg.Pool[Any],
) -> None:
    queue = PgTaskQueue(pool, committing_groups=2)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    created = await create_task(pool)
    await versions.publish_version(pool, created, 2)
    others = [await create_task(pool) for _ in range(4)]
    leases = await queue.claim("standard", "w1", lease_seconds=60, limit=6)
    assert len(leases) == 6
    older, newer = sorted(
        (lease for lease in leases if lease.document_id == created.document_id),
        key=lambda lease: lease.version_number,
    )
    rest = [lease for lease in leases if lease.document_id != created.document_id]
    assert {lease.document_id for lease in rest} == {other.document_id for other in others}
    # The newer version first and alone: written, its transaction held open with the
    # document's pointer locked. The older arrives with others and goes in the second
    # group, which commits beside it and waits for that lock.
    paused = PausedWrite(write_for(sink, newer))
    first = asyncio.create_task(queue.complete(newer, in_transaction=paused))
    await paused.reached.wait()
    second = [
        asyncio.create_task(queue.complete(lease, in_transaction=write_for(sink, lease)))
        for lease in (older, *rest)
    ]
    await wait_until_blocked_on_a_lock(pool)
    assert not any(task.done() for task in second)
    paused.release.set()
    await asyncio.wait_for(asyncio.gather(first, *second), 60)
    served = await pool.fetchval(
        "SELECT version_number FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    assert served == 2
    for lease in (older, newer, *rest):
        assert await status(pool, lease) is TaskStatus.SUCCEEDED
    for lease in rest:
        assert await indexed(pool, lease.document_id) == (1, True, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("committing_groups", [1, 2])
async def test_completions_one_after_the_other_each_commit(
    pool: asyncpg.Pool[Any], committing_groups: int
) -> None:
    # At low load each completion is a group of its own, queued just as the last
    # committer found nothing left to do.
    queue = PgTaskQueue(pool, committing_groups=committing_groups)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    leases = await claimed(pool, queue, 4)
    writes = [write_for(sink, lease) for lease in leases]
    for lease, write in zip(leases, writes, strict=True):
        # Nothing awaited between one completion's end and the next one's start (a lost
        # committer would hang here: the test's timeout fails it).
        await queue.complete(lease, in_transaction=write)
    for lease in leases:
        assert await status(pool, lease) is TaskStatus.SUCCEEDED


async def test_a_group_is_one_span_and_each_switch_in_its_own_trace_links_to_it(
    pool: asyncpg.Pool[Any],
) -> None:
    groups, queue, sink = await grouped(pool)
    # Each task in a trace of its own, as each attempt's span would carry it.
    leases = [
        replace(lease, traceparent=f"00-{n + 1:032x}-{n + 1:016x}-01")
        for n, lease in enumerate(await claimed(pool, queue, 3))
    ]
    with traced() as exported:
        await asyncio.gather(
            *(queue.complete(lease, in_transaction=write_for(sink, lease)) for lease in leases)
        )
        spans = exported.get_finished_spans()
    assert groups == [3]
    group = one(spans, "kb.index.group_commit")  # one for the three, not one a task
    assert group.attributes is not None
    assert group.attributes["db.operation.batch.size"] == 3
    # Under one of the tasks' attempts (the first in write order).
    assert (trace_id(group), parent_id(group)) in {(1, 1), (2, 2), (3, 3)}
    switches = named(spans, "kb.index.switch")
    assert sorted((trace_id(s), parent_id(s)) for s in switches) == [(1, 1), (2, 2), (3, 3)]
    for switch in switches:
        assert linked_span_ids(switch) == [span_id(group)]
