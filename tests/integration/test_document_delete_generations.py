"""A delete is not undone by index generations (docs/architecture.md#document-lifecycle):
`kb index generations create` backfills no task for a deleted document, and a switch --
plain or --force, whether the target holds the document or not -- leaves its tombstone as
it is, so the document stays out of search."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from services.indexer.generations.store_pg import PgGenerations
from services.publisher.domain import Publisher
from services.publisher.store_pg import PgPublisherStore
from tests.support.generations import (
    NEW_MODEL,
    Doc,
    add_document,
    build,
    new_generation,
    pointers,
    register_default,
)

pytestmark = pytest.mark.integration


async def deleted(pool: asyncpg.Pool[Any], doc: Doc) -> None:
    revision = await pool.fetchval(
        "SELECT revision FROM document WHERE document_id = $1", doc.document_id
    )
    await Publisher(PgPublisherStore(pool), max_upload_bytes=1024).delete_document(
        doc.tenant_id, doc.document_id, expected_revision=revision
    )


async def tombstone(pool: asyncpg.Pool[Any], doc: Doc) -> tuple[Any, ...]:
    row = await pool.fetchrow(
        "SELECT version_number, embedding_model, chunking_strategy, chunk_count, deleted_at"
        " FROM document_search_version WHERE document_id = $1",
        doc.document_id,
    )
    assert row is not None
    assert row["deleted_at"] is not None
    assert row["chunking_strategy"] is None
    return tuple(row.values())


async def backfill_tasks(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> int:
    count: int = await pool.fetchval(
        "SELECT count(*) FROM index_task WHERE document_id = $1 AND generation_id IS NOT NULL",
        document_id,
    )
    return count


@pytest.mark.parametrize("force", [False, True])
async def test_a_new_generation_and_its_switch_leave_a_deleted_document_deleted(
    pool: asyncpg.Pool[Any], force: bool
) -> None:
    await register_default(pool)
    kept = await add_document(pool, "acme")
    gone = await add_document(pool, "acme")
    gone_built = await add_document(pool, "acme")
    await deleted(pool, gone)
    await deleted(pool, gone_built)
    before = {doc.document_id: await tombstone(pool, doc) for doc in (gone, gone_built)}

    generation_id = await new_generation(pool, ["acme"])
    # The backfill builds the kept document only.
    assert await backfill_tasks(pool, kept.document_id) == 1
    assert await backfill_tasks(pool, gone.document_id) == 0
    assert await backfill_tasks(pool, gone_built.document_id) == 0

    # One deleted document the target holds anyway (built before its delete), one it does
    # not: neither blocks the switch, neither is rewritten, dropped or served again.
    await build(pool, kept, generation_id)
    await build(pool, gone_built, generation_id)
    outcome = await PgGenerations(pool).switch("acme", generation_id, force=force)
    assert outcome.switched
    assert outcome.dropped == []
    served = await pointers(pool, "acme")
    assert served[kept.document_id][:2] == (1, NEW_MODEL)
    for doc in (gone, gone_built):
        assert await tombstone(pool, doc) == before[doc.document_id]
