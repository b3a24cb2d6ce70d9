"""services.runtime.indexing.tasks.enqueue_index_task: one task per business key, however often and
however concurrently it is asked for."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from services.runtime.indexing.tasks import (
    TASK_TYPE_INDEX_VERSION,
    TaskStatus,
    enqueue_index_task,
    index_task_from_row,
)
from tests.support.tasks import CreatedTask, create_task

pytestmark = pytest.mark.integration


async def _version_without_task(pool: asyncpg.Pool[Any]) -> CreatedTask:
    created = await create_task(pool)
    await pool.execute("DELETE FROM index_task WHERE task_id = $1", created.task_id)
    return created


async def test_enqueue_creates_once_and_then_answers_the_same_task(
    pool: asyncpg.Pool[Any],
) -> None:
    version = await _version_without_task(pool)
    key: dict[str, Any] = {
        "tenant_id": version.tenant_id,
        "document_id": version.document_id,
        "version_number": 1,
        "tier": version.tier,
    }
    async with pool.acquire() as conn, conn.transaction():
        first = await enqueue_index_task(conn, **key, max_attempts=5)
    async with pool.acquire() as conn, conn.transaction():
        again = await enqueue_index_task(conn, **key)
    assert first.created
    assert again == (first.task_id, False)
    row = await pool.fetchrow("SELECT * FROM index_task WHERE task_id = $1", first.task_id)
    assert row is not None
    task = index_task_from_row(row)
    assert (task.status, task.task_type, task.max_attempts, task.attempts) == (
        TaskStatus.PENDING,
        TASK_TYPE_INDEX_VERSION,
        5,
        0,
    )
    assert await pool.fetchval("SELECT count(*) FROM index_task") == 1


async def test_concurrent_enqueues_of_one_key_make_one_task(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    version = await _version_without_task(pool)
    key: dict[str, Any] = {
        "tenant_id": version.tenant_id,
        "document_id": version.document_id,
        "version_number": 1,
        "tier": version.tier,
    }
    first_conn = await asyncpg.connect(database_url)
    second_conn = await asyncpg.connect(database_url)
    try:
        first_tx = first_conn.transaction()
        await first_tx.start()
        first = await enqueue_index_task(first_conn, **key)
        # The second waits on the first's uncommitted row of the same key...
        second = asyncio.create_task(_enqueue_in_transaction(second_conn, key))
        await _waits_for_a_lock(pool, second_conn.get_server_pid(), second)
        assert not second.done()
        await first_tx.commit()
        # ...and, once it committed, answers that task instead of making another.
        assert await asyncio.wait_for(second, 10) == (first.task_id, False)
    finally:
        await first_conn.close()
        await second_conn.close()
    assert first.created
    assert await pool.fetchval("SELECT count(*) FROM index_task") == 1


async def test_an_enqueue_behind_one_that_rolled_back_creates_the_task(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    version = await _version_without_task(pool)
    key: dict[str, Any] = {
        "tenant_id": version.tenant_id,
        "document_id": version.document_id,
        "version_number": 1,
        "tier": version.tier,
    }
    first_conn = await asyncpg.connect(database_url)
    second_conn = await asyncpg.connect(database_url)
    try:
        first_tx = first_conn.transaction()
        await first_tx.start()
        await enqueue_index_task(first_conn, **key)
        second = asyncio.create_task(_enqueue_in_transaction(second_conn, key))
        await _waits_for_a_lock(pool, second_conn.get_server_pid(), second)
        await first_tx.rollback()
        made = await asyncio.wait_for(second, 10)
    finally:
        await first_conn.close()
        await second_conn.close()
    assert made.created
    assert await pool.fetchval("SELECT task_id FROM index_task") == made.task_id


async def _waits_for_a_lock(pool: asyncpg.Pool[Any], pid: int, task: asyncio.Task[Any]) -> None:
    """Until the backend ``pid`` waits for a lock (``task`` must not finish first)."""
    async with asyncio.timeout(10):
        while True:
            assert not task.done(), "the second enqueue did not wait for the first"
            waiting = await pool.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
            )
            if waiting:
                return
            # Another backend's state: asking the server again is the only signal there is.
            await asyncio.sleep(0.01)


async def _enqueue_in_transaction(conn: asyncpg.Connection[Any], key: dict[str, Any]) -> Any:
    async with conn.transaction():
        return await enqueue_index_task(conn, **key)
