"""The search pointer never names an older version than it did, whatever the statement:
0006's trigger refuses an UPDATE back, and each document's high-water mark (migration 0021)
refuses a DELETE followed by an INSERT of an older version, at once or racing a switch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import asyncpg
import numpy as np
import pytest

from services.index.generation import IndexGeneration
from services.indexer.chunk import Chunk
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import TaskStatus
from services.runtime.pg.db import create_pool
from services.runtime.pg.migrations import apply_migrations, load_migrations
from services.runtime.settings import RuntimeSettings
from tests.support import versions
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.stack import Stack, create_test_database, drop_test_database
from tests.support.tasks import CreatedTask, create_task

pytestmark = pytest.mark.integration

GENERATION = IndexGeneration("forward-model-8", 8, "heading-semchunk-v1:max=64")
MOVED_BACK = "cannot move back"


def chunks_of(created: CreatedTask, version: int) -> list[Chunk]:
    return versions.make_chunks(
        created.document_id, version, [f"v{version}"], GENERATION.chunking_strategy
    )


async def index(pool: asyncpg.Pool[Any], sink: PgVectorSink, created: CreatedTask) -> None:
    """Runs every due task of the tier through the sink, oldest version first."""
    queue = PgTaskQueue(pool)
    for lease in sorted(
        await queue.claim("standard", "w", lease_seconds=30, limit=10),
        key=lambda lease: lease.version_number,
    ):
        vectors = np.ones((1, GENERATION.dimension), dtype=np.float32)
        chunks = chunks_of(created, lease.version_number)
        await queue.complete(lease, in_transaction=sink.writer(lease, GENERATION, chunks, vectors))


async def served_version(db: asyncpg.Pool[Any], created: CreatedTask) -> int | None:
    version: int | None = await db.fetchval(
        "SELECT version_number FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    return version


Executor: TypeAlias = (
    "asyncpg.Pool[Any] | asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]"
)


async def reinsert(db: Executor, created: CreatedTask, version: int) -> None:
    await db.execute(
        "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
        " embedding_model, chunking_strategy, chunk_count) VALUES ($1, $2, $3, $4, $5, 1)",
        created.tenant_id,
        created.document_id,
        version,
        GENERATION.embedding_model,
        GENERATION.chunking_strategy,
    )


@pytest.fixture
async def sink(pool: asyncpg.Pool[Any]) -> PgVectorSink:
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    return sink


@pytest.fixture
async def served_v2(pool: asyncpg.Pool[Any], sink: PgVectorSink) -> CreatedTask:
    """A document whose pointer moved v1 -> v2."""
    created = await create_task(pool)
    await index(pool, sink, created)
    await versions.publish_version(pool, created, 2)
    await index(pool, sink, created)
    assert await served_version(pool, created) == 2
    return created


async def test_a_deleted_pointer_is_never_inserted_again_at_an_older_version(
    pool: asyncpg.Pool[Any], served_v2: CreatedTask
) -> None:
    delete = "DELETE FROM document_search_version WHERE document_id = $1"
    # In one transaction ...
    with pytest.raises(asyncpg.CheckViolationError, match=MOVED_BACK):
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(delete, served_v2.document_id)
            await reinsert(conn, served_v2, 1)
    assert await served_version(pool, served_v2) == 2
    # ... or in two: the delete is allowed (the document is then not searchable, which
    # `kb index check` repairs), the older insert is not.
    await pool.execute(delete, served_v2.document_id)
    with pytest.raises(asyncpg.CheckViolationError, match=MOVED_BACK):
        await reinsert(pool, served_v2, 1)
    assert await served_version(pool, served_v2) is None
    # The version it served, or a newer one, may come back.
    await reinsert(pool, served_v2, 2)
    assert await served_version(pool, served_v2) == 2
    # And the UPDATE path still refuses as before (0006's trigger).
    with pytest.raises(asyncpg.CheckViolationError, match=MOVED_BACK):
        await pool.execute(
            "UPDATE document_search_version SET version_number = 1 WHERE document_id = $1",
            served_v2.document_id,
        )


async def test_the_high_water_mark_only_rises(
    pool: asyncpg.Pool[Any], served_v2: CreatedTask
) -> None:
    mark = "SELECT version_number FROM document_search_version_high_water WHERE document_id = $1"
    assert await pool.fetchval(mark, served_v2.document_id) == 2
    for statement in (
        "DELETE FROM document_search_version_high_water WHERE document_id = $1",
        "UPDATE document_search_version_high_water SET version_number = 1 WHERE document_id = $1",
    ):
        with pytest.raises(asyncpg.CheckViolationError, match="only rises"):
            await pool.execute(statement, served_v2.document_id)
    with pytest.raises(asyncpg.CheckViolationError, match="only rises"):
        await pool.execute("TRUNCATE document_search_version_high_water")
    assert await pool.fetchval(mark, served_v2.document_id) == 2


async def test_a_document_that_goes_takes_its_mark_with_it(
    pool: asyncpg.Pool[Any], served_v2: CreatedTask
) -> None:
    """The one way a mark goes: with its document (nothing deletes documents today; a
    deletion would take the pointer, the index and the tasks first)."""
    document_id = served_v2.document_id
    async with pool.acquire() as conn, conn.transaction():
        for table in (
            "document_search_version",
            "knowledge_chunk",
            "index_task",
            "document_version",
            "document",
        ):
            await conn.execute(f"DELETE FROM {table} WHERE document_id = $1", document_id)
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM document_search_version_high_water WHERE document_id = $1",
            document_id,
        )
        == 0
    )


async def test_a_late_older_task_after_the_pointer_was_deleted_succeeds_without_switching(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    v2_task = await versions.publish_version(pool, created, 2)
    queue = PgTaskQueue(pool)
    leases = await queue.claim("standard", "w", lease_seconds=30, limit=2)
    v1, v2 = sorted(leases, key=lambda lease: lease.version_number)
    assert v2.task_id == v2_task
    vectors = np.ones((1, GENERATION.dimension), dtype=np.float32)
    await queue.complete(
        v2, in_transaction=sink.writer(v2, GENERATION, chunks_of(created, 2), vectors)
    )
    await pool.execute(
        "DELETE FROM document_search_version WHERE document_id = $1", created.document_id
    )

    await queue.complete(
        v1, in_transaction=sink.writer(v1, GENERATION, chunks_of(created, 1), vectors)
    )
    task = await queue.get(v1.task_id)
    assert task is not None
    assert task.status is TaskStatus.SUCCEEDED
    assert await served_version(pool, created) is None


@pytest.fixture
async def wide_pool(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await create_pool(settings, min_size=3, max_size=3)
    try:
        yield pool
    finally:
        await pool.close()


async def test_a_delete_and_older_insert_racing_a_switch_is_refused_once_the_switch_commits(
    wide_pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(wide_pool)
    await index(wide_pool, sink, created)
    await versions.publish_version(wide_pool, created, 2)
    async with wide_pool.acquire() as switching:
        switch = switching.transaction()
        await switch.start()
        # A forward switch, not committed yet: it holds the pointer row and the mark.
        await switching.execute(
            "UPDATE document_search_version SET version_number = 2 WHERE document_id = $1",
            created.document_id,
        )

        async def delete_and_insert_v1() -> None:
            async with wide_pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    "DELETE FROM document_search_version WHERE document_id = $1",
                    created.document_id,
                )
                await reinsert(conn, created, 1)

        racing = asyncio.create_task(delete_and_insert_v1())
        await wait_until_blocked_on_a_lock(wide_pool)
        await switch.commit()
        with pytest.raises(asyncpg.CheckViolationError, match=MOVED_BACK):
            await racing
    assert await served_version(wide_pool, created) == 2


@pytest.fixture
async def database_before_0021(stack: Stack) -> AsyncIterator[asyncpg.Connection[Any]]:
    name = await create_test_database(stack, "template0")
    conn = await asyncpg.connect(stack.database_url(name))
    try:
        await apply_migrations(conn, [m for m in load_migrations() if m.version < 21])
        yield conn
    finally:
        await conn.close()
        await drop_test_database(stack, name)


async def test_the_migration_marks_the_pointers_that_exist(
    database_before_0021: asyncpg.Connection[Any],
) -> None:
    conn = database_before_0021
    created = await create_task(conn)
    await versions_published(conn, created, 2)
    await reinsert(conn, created, 2)

    await apply_migrations(conn, load_migrations())

    await conn.execute(
        "DELETE FROM document_search_version WHERE document_id = $1", created.document_id
    )
    with pytest.raises(asyncpg.CheckViolationError, match=MOVED_BACK):
        await reinsert(conn, created, 1)


async def versions_published(
    conn: asyncpg.Connection[Any], created: CreatedTask, version: int
) -> None:
    """Version ``version`` of the document, published (no task: the pointer is written by
    hand here)."""
    await conn.execute(
        """
        INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                      media_type, sha256, size_bytes, status, published_at)
        VALUES ($1, $2, $3, 'x', 'text/plain', sha256('x'), 1, 'PUBLISHED', now())
        """,
        created.tenant_id,
        created.document_id,
        version,
    )
    await conn.execute(
        "UPDATE document SET latest_version = $2, published_version = $2 WHERE document_id = $1",
        created.document_id,
        version,
    )
