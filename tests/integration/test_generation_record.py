"""What a generation holds of a document (``document_generation_version``), written by one
statement (``upsert_document_generation_version`` in services/indexer/sink/generations.sql)
for its two writers, and which comparison each needs at the same version (issue 42: the
statement was written twice, with ``<=`` in one and ``<`` in the other).

- A completion builds the version: a re-run at the same version replaced the version's chunk
  set, so its record is rewritten (``<=``: with ``<`` the record would name chunks that were
  deleted, and a switch would serve them).
- `kb index generations create` copies a pinned tenant's served pointers into the default
  generation: a pointer only mirrors what a completion recorded, so the copy moves a record
  forward or adds a missing one, and leaves a record at the pointer's version as the
  completion wrote it (``<``).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.index.generation import IndexGeneration
from services.indexer.sink.generations import record_versions
from services.indexer.task import TASK_TYPE_INDEX_VERSION, Lease
from tests.support.generations import (
    OLD_MODEL,
    OLD_SETTINGS,
    OLD_STRATEGY,
    Doc,
    add_document,
    new_generation,
    register_default,
)

pytestmark = pytest.mark.integration

RERUN_STRATEGY = OLD_SETTINGS + ":code=cccc"


async def _complete(
    pool: asyncpg.Pool[Any], doc: Doc, generation_id: int, version: int, strategy: str, count: int
) -> None:
    """What a fenced completion records of the generation it builds."""
    lease = Lease(
        task_id=uuid.uuid4(),
        owner="worker-1",
        lease_attempt=1,
        lease_until=datetime.now(UTC),
        tenant_id=doc.tenant_id,
        document_id=doc.document_id,
        version_number=version,
        task_type=TASK_TYPE_INDEX_VERSION,
        tier="standard",
        max_attempts=3,
        generation_id=generation_id,
    )
    generation = IndexGeneration(OLD_MODEL, 3, strategy)
    async with pool.acquire() as conn, conn.transaction():
        await record_versions(conn, [(lease, generation_id, generation, count)], None)


async def _record(pool: asyncpg.Pool[Any], doc: Doc, generation_id: int) -> tuple[Any, ...]:
    row = await pool.fetchrow(
        """
        SELECT version_number, chunking_strategy, chunk_count
          FROM document_generation_version
         WHERE tenant_id = $1 AND document_id = $2 AND generation_id = $3
        """,
        doc.tenant_id,
        doc.document_id,
        generation_id,
    )
    assert row is not None
    return tuple(row.values())


async def test_a_rerun_at_the_same_version_rewrites_what_the_generation_holds(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    doc = await add_document(pool, "acme", served=1)
    await _complete(pool, doc, default, 1, OLD_STRATEGY, 2)
    await _complete(pool, doc, default, 1, RERUN_STRATEGY, 5)
    assert await _record(pool, doc, default) == (1, RERUN_STRATEGY, 5)


async def test_an_older_version_finishing_late_leaves_the_record_alone(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    doc = await add_document(pool, "acme", served=2, published=2)
    await _complete(pool, doc, default, 2, OLD_STRATEGY, 2)
    await _complete(pool, doc, default, 1, RERUN_STRATEGY, 5)
    assert await _record(pool, doc, default) == (2, OLD_STRATEGY, 2)


async def test_create_leaves_a_completions_record_at_the_served_version_as_it_was_written(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    doc = await add_document(pool, "acme", served=1)  # the pointer: v1, OLD_STRATEGY, 2
    await _complete(pool, doc, default, 1, RERUN_STRATEGY, 5)
    await new_generation(pool, ["acme"])
    assert await _record(pool, doc, default) == (1, RERUN_STRATEGY, 5)


async def test_create_moves_an_older_record_forward_and_adds_a_missing_one(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    behind = await add_document(pool, "acme", served=2, published=2)
    await _complete(pool, behind, default, 1, RERUN_STRATEGY, 5)
    missing = await add_document(pool, "acme", served=1)
    await new_generation(pool, ["acme"])
    assert await _record(pool, behind, default) == (2, OLD_STRATEGY, 2)
    assert await _record(pool, missing, default) == (1, OLD_STRATEGY, 2)
