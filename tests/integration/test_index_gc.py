"""The collector of superseded chunks on real PostgreSQL: per chunk family (model and chunk
settings) it keeps the served version and KB_INDEX_KEEP_PREVIOUS below it, never a newer
version, never a family nothing serves; it works in bounded batches, leaves a document
marked until its last batch, and collectors running at once never take the same document."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from services.index.generation import CODE_MARK
from services.indexer.gc.collector import GarbageCollector, mark_document
from services.indexer.gc.settings import GcSettings
from tests.support.tasks import create_task
from tests.support.versions import publish_version

pytestmark = pytest.mark.integration

MODEL = "hashing-v1-4"
SETTINGS = "heading-semchunk-v1:max=64"


async def add_chunks(
    pool: asyncpg.Pool[Any],
    tenant: str,
    document: uuid.UUID,
    version: int,
    *,
    count: int = 3,
    model: str = MODEL,
    strategy: str = SETTINGS + CODE_MARK + "aaaa",
) -> None:
    await pool.execute(
        """
        INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                                     chunking_strategy, chunk_id, ordinal, heading_path, text,
                                     content_digest, embedding_dimension, embedding)
        SELECT $1, $2, $3::integer, $4, $5::text, $5::text || ':' || $3::integer || ':' || n, n,
               ARRAY['h'], 'text ' || n, sha256(($3::integer || ':' || n)::bytea), 4, '[1,0,0,0]'
          FROM generate_series(0, $6 - 1) AS n
        """,
        tenant,
        document,
        version,
        model,
        strategy,
        count,
    )


async def point(
    pool: asyncpg.Pool[Any], tenant: str, document: uuid.UUID, version: int, strategy: str
) -> None:
    await pool.execute(
        """
        INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                             embedding_model, chunking_strategy, chunk_count)
        VALUES ($1, $2, $3, $4, $5, 3)
        ON CONFLICT (tenant_id, document_id) DO UPDATE
           SET version_number = EXCLUDED.version_number,
               chunking_strategy = EXCLUDED.chunking_strategy
        """,
        tenant,
        document,
        version,
        MODEL,
        strategy,
    )


async def versions_left(pool: asyncpg.Pool[Any], document: uuid.UUID) -> dict[str, list[int]]:
    rows = await pool.fetch(
        """
        SELECT embedding_model, array_agg(DISTINCT version_number ORDER BY version_number) AS v
          FROM knowledge_chunk WHERE document_id = $1 GROUP BY embedding_model
        """,
        document,
    )
    return {row["embedding_model"]: list(row["v"]) for row in rows}


async def document_with_versions(pool: asyncpg.Pool[Any], versions: int) -> tuple[str, uuid.UUID]:
    created = await create_task(pool)
    for version in range(2, versions + 1):
        await publish_version(pool, created, version)
    return created.tenant_id, created.document_id


async def mark(pool: asyncpg.Pool[Any], tenant: str, document: uuid.UUID) -> None:
    async with pool.acquire() as conn:
        await mark_document(conn, tenant, document)


async def test_keeps_the_served_version_and_the_previous_ones_it_is_told_to(
    pool: asyncpg.Pool[Any],
) -> None:
    tenant, document = await document_with_versions(pool, 5)
    for version in range(1, 6):
        # An older code digest on the oldest versions: the same family all the same.
        code = "old" if version < 3 else "new"
        await add_chunks(pool, tenant, document, version, strategy=SETTINGS + CODE_MARK + code)
    # Version 5 is staged by a completion that has not switched yet: above the served one.
    await point(pool, tenant, document, 4, SETTINGS + CODE_MARK + "new")
    # Another model nothing serves (a generation being retired): left to its retirement.
    await add_chunks(pool, tenant, document, 1, model="retiring-model")
    await mark(pool, tenant, document)

    collected = await GarbageCollector(
        pool, GcSettings(keep_previous=1, gc_batch_rows=1000)
    ).collect(max_documents=10)

    assert collected.documents == 1
    assert collected.chunks == 2 * 3  # versions 1 and 2
    assert await versions_left(pool, document) == {MODEL: [3, 4, 5], "retiring-model": [1]}
    assert await pool.fetchval("SELECT count(*) FROM index_gc_due") == 0


async def test_keep_previous_zero_keeps_only_what_is_served(pool: asyncpg.Pool[Any]) -> None:
    tenant, document = await document_with_versions(pool, 3)
    for version in (1, 2, 3):
        await add_chunks(pool, tenant, document, version)
    await point(pool, tenant, document, 3, SETTINGS + CODE_MARK + "aaaa")
    await mark(pool, tenant, document)

    await GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=1000)).collect(
        max_documents=1
    )

    assert await versions_left(pool, document) == {MODEL: [3]}


async def test_a_generation_built_beside_the_served_one_is_collected_against_its_own_version(
    pool: asyncpg.Pool[Any],
) -> None:
    tenant, document = await document_with_versions(pool, 3)
    generation = await pool.fetchval(
        """
        INSERT INTO search_generation (provider_profile, embedding_model, dimension,
                                       chunk_max_tokens, chunk_overlap_tokens, chunking_settings)
        VALUES ('default', 'next-model', 4, 64, 0, $1) RETURNING generation_id
        """,
        SETTINGS,
    )
    for version in (1, 2, 3):
        await add_chunks(pool, tenant, document, version)
        await add_chunks(pool, tenant, document, version, model="next-model")
    await point(pool, tenant, document, 3, SETTINGS + CODE_MARK + "aaaa")
    # The generation being built has reached version 2 only.
    await pool.execute(
        """
        INSERT INTO document_generation_version (tenant_id, document_id, generation_id,
                                                 version_number, chunking_strategy, chunk_count)
        VALUES ($1, $2, $3, 2, $4, 3)
        """,
        tenant,
        document,
        generation,
        SETTINGS + CODE_MARK + "aaaa",
    )
    await mark(pool, tenant, document)

    await GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=1000)).collect(
        max_documents=1
    )

    assert await versions_left(pool, document) == {MODEL: [3], "next-model": [2, 3]}


async def test_a_large_document_is_collected_in_batches_and_stays_marked_until_clean(
    pool: asyncpg.Pool[Any],
) -> None:
    tenant, document = await document_with_versions(pool, 2)
    await add_chunks(pool, tenant, document, 1, count=25)
    await add_chunks(pool, tenant, document, 2, count=5)
    await point(pool, tenant, document, 2, SETTINGS + CODE_MARK + "aaaa")
    await mark(pool, tenant, document)
    collector = GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=10))

    rounds = [await collector.collect(max_documents=1) for _ in range(4)]

    assert [r.chunks for r in rounds] == [10, 10, 5, 0]
    assert [r.documents for r in rounds] == [1, 1, 1, 0]
    assert await versions_left(pool, document) == {MODEL: [2]}
    assert await pool.fetchval("SELECT count(*) FROM index_gc_due") == 0


async def test_a_round_shares_its_batch_among_a_tenants_documents_and_keeps_them_if_full(
    pool: asyncpg.Pool[Any],
) -> None:
    documents = []
    for _ in range(3):
        tenant, document = await document_with_versions(pool, 2)
        await add_chunks(pool, tenant, document, 1, count=4)
        await add_chunks(pool, tenant, document, 2, count=1)
        await point(pool, tenant, document, 2, SETTINGS + CODE_MARK + "aaaa")
        await mark(pool, tenant, document)
        documents.append(document)
    collector = GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=10))

    # 12 superseded rows: the first round deletes a batch of 10 of them, among the three
    # documents, and cannot tell which are clean: all three stay marked.
    first = await collector.collect(max_documents=3)
    assert (first.documents, first.chunks) == (3, 10)
    assert await pool.fetchval("SELECT count(*) FROM index_gc_due") == 3
    second = await collector.collect(max_documents=3)
    assert (second.documents, second.chunks) == (3, 2)
    assert await pool.fetchval("SELECT count(*) FROM index_gc_due") == 0
    for document in documents:
        assert await versions_left(pool, document) == {MODEL: [2]}


async def test_collectors_at_once_never_take_the_same_document(pool: asyncpg.Pool[Any]) -> None:
    documents = []
    for _ in range(6):
        tenant, document = await document_with_versions(pool, 2)
        await add_chunks(pool, tenant, document, 1)
        await add_chunks(pool, tenant, document, 2)
        await point(pool, tenant, document, 2, SETTINGS + CODE_MARK + "aaaa")
        await mark(pool, tenant, document)
        documents.append(document)

    collectors = [
        GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=100)) for _ in range(3)
    ]
    rounds = await asyncio.gather(*(c.collect(max_documents=6) for c in collectors))

    assert sum(r.documents for r in rounds) == 6
    assert sum(r.chunks for r in rounds) == 6 * 3
    for document in documents:
        assert await versions_left(pool, document) == {MODEL: [2]}


async def test_marking_twice_is_one_mark(pool: asyncpg.Pool[Any]) -> None:
    tenant, document = await document_with_versions(pool, 1)
    await mark(pool, tenant, document)
    await mark(pool, tenant, document)
    assert await pool.fetchval("SELECT count(*) FROM index_gc_due") == 1
