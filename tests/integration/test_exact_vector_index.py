"""The exact vector list's index (migrations/0017): chunks of models of up to 512 dimensions
are ranked from its leaves, larger models' chunks stay out of it and are ranked from their
rows, and the largest entry it may be asked to hold fits (real PostgreSQL)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import numpy as np
import pytest

from services.runtime.settings import RuntimeSettings
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings, VectorPath
from tests.support.api import add_tenant
from tests.support.search import (
    EXACT_MAX_CHUNKS,
    ChunkSpec,
    SearchHarness,
    add_document,
    add_version,
    point_search_at,
    search_harness,
)

pytestmark = pytest.mark.integration

DOCUMENTS = 40
CHUNKS_PER_DOCUMENT = 10


async def _corpus(harness: SearchHarness, conn: asyncpg.Connection[Any]) -> str:
    """40 documents of ten chunks, the first three readable by group:few; VACUUMed, as
    autovacuum leaves written chunks (an index-only scan reads pages all-visible)."""
    await add_tenant(conn, "acme", "standard")
    random = np.random.default_rng(7)
    for n in range(DOCUMENTS):
        read = ("group:all", "group:few") if n < 3 else ("group:all",)
        document_id = await add_document(conn, "acme", title=f"Doc {n}", read=read)
        # Rows as wide as a real chunk's (text beside the vector): what the index spares.
        chunks = [
            ChunkSpec(f"clause {c} of policy {n}: " + "refunds are due within days. " * 40)
            for c in range(CHUNKS_PER_DOCUMENT)
        ]
        # Random vectors: no two chunks at one distance from the query, one right order.
        vectors = random.standard_normal((CHUNKS_PER_DOCUMENT, harness.embedder.dimension))
        await add_version(conn, "acme", document_id, 1, chunks, harness.embedder, vectors=vectors)
        await point_search_at(conn, "acme", document_id, 1, harness.embedder.model)
    partition: str = await conn.fetchval(
        "SELECT tableoid::regclass::text FROM knowledge_chunk WHERE tenant_id = 'acme' LIMIT 1"
    )
    await _vacuum_until_all_visible(conn, partition)
    await conn.execute("ANALYZE")
    return partition


async def _vacuum_until_all_visible(conn: asyncpg.Connection[Any], partition: str) -> None:
    """VACUUM until every page of ``partition`` is all-visible. A streaming replica of the
    test cluster (started by other tests, `hot_standby_feedback=on`) holds the horizon back
    until its next feedback, and VACUUM cannot mark rows newer than the horizon visible to
    all: the planner would then rightly prefer the heap to an index-only scan."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        await conn.execute(f"VACUUM (ANALYZE) {partition}")
        row = await conn.fetchrow(
            "SELECT relpages, relallvisible FROM pg_class WHERE oid = $1::regclass",
            partition,
        )
        assert row is not None
        pages, visible = row["relpages"], row["relallvisible"]
        if visible >= pages:
            return
        if asyncio.get_running_loop().time() > deadline:
            slots = await conn.fetch(
                "SELECT slot_name, active, xmin FROM pg_replication_slots WHERE xmin IS NOT NULL"
            )
            raise AssertionError(
                f"VACUUM left {pages - visible} of {pages} pages of {partition} not all-visible;"
                f" a replication slot holding the horizon back? {[dict(s) for s in slots]}"
                " (a stopped replica's slot does: drop it, or start the replica)"
            )
        await asyncio.sleep(0.2)


@dataclass
class Exact:
    harness: SearchHarness
    partition: str
    index: PgSearchIndex


@pytest.fixture(params=[64, 768], ids=["64-dimensions", "768-dimensions"])
async def exact(
    request: pytest.FixtureRequest, settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> AsyncIterator[Exact]:
    async with search_harness(settings, dimension=request.param) as harness:
        index = PgSearchIndex(
            harness.pool,
            Generation(harness.embedder.model, harness.embedder.dimension),
            SearchSettings(
                database_url=settings.database_url,
                search_exact_max_chunks=EXACT_MAX_CHUNKS[VectorPath.EXACT],
            ),
        )
        yield Exact(harness, await _corpus(harness, conn), index)


async def _chunk_scans(exact: Exact) -> list[tuple[str, str]]:
    """The scans of the tenant's partition in the exact vector list's plan (enable_seqscan
    off: on a partition this small a sequential scan would be cheaper than any index)."""
    harness, partition, index = exact.harness, exact.partition, exact.index
    vector = harness.embedder.embed_sync(["refunds"])[0]
    async with (
        harness.pool.acquire() as conn,
        conn.transaction(readonly=True, isolation="repeatable_read"),
    ):
        request = SearchRequest("acme", "refunds", ("group:few",), 10, SearchMode.VECTOR)
        assert await index.vector_path(conn, request) is VectorPath.EXACT
        await conn.execute("SET LOCAL enable_seqscan = off")
        plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + index.vector_statement(VectorPath.EXACT),
            "acme",
            ["group:few"],
            None,
            None,
            10,
            vector,
        )
    scans = []
    pending = [entry["Plan"] for entry in json.loads(plan)]
    while pending:
        node = pending.pop()
        pending.extend(node.get("Plans", []))
        if node.get("Relation Name") == partition:
            scans.append((node["Node Type"], node["Index Name"]))
    return sorted(scans)


async def _exact_index_of(conn: asyncpg.Connection[Any], partition: str) -> str:
    name: str = await conn.fetchval(
        "SELECT i.inhrelid::regclass::text FROM pg_inherits i"
        "  JOIN pg_index x ON x.indexrelid = i.inhrelid"
        " WHERE i.inhparent = 'knowledge_chunk_exact'::regclass"
        "   AND x.indrelid = $1::regclass",
        partition,
    )
    return name


async def test_the_exact_list_ranks_from_the_index_only_for_models_it_can_hold(
    exact: Exact, conn: asyncpg.Connection[Any]
) -> None:
    api, partition = exact.harness, exact.partition
    scans = await _chunk_scans(exact)
    primary_key = f"{partition}_pkey"
    if api.embedder.dimension <= 512:
        # Every readable chunk ranked from the index's leaves; only the nearest read from
        # their rows (by primary key), for their text.
        assert scans == [
            ("Index Only Scan", await _exact_index_of(conn, partition)),
            ("Index Scan", primary_key),
        ]
    else:
        # Not in the index: ranked from the rows, the nearest read again for their text.
        assert scans == [("Index Scan", primary_key), ("Index Scan", primary_key)]


async def test_the_exact_list_is_every_readable_chunk_nearest_first(
    exact: Exact, conn: asyncpg.Connection[Any]
) -> None:
    api = exact.harness
    rows = await conn.fetch(
        "SELECT c.chunk_id, c.text, c.embedding::text AS embedding"
        "  FROM knowledge_chunk c JOIN document_acl a USING (tenant_id, document_id)"
        " WHERE c.tenant_id = 'acme' AND a.principal = 'group:few'"
    )
    query = np.random.default_rng(8).standard_normal(api.embedder.dimension)

    def distance(embedding: str) -> float:
        vector = np.asarray(json.loads(embedding), dtype=np.float64)
        return 1 - float(vector @ query / np.linalg.norm(vector) / np.linalg.norm(query))

    expected = sorted(rows, key=lambda r: distance(r["embedding"]))[:10]
    request = SearchRequest("acme", "refunds", ("group:few",), 10, SearchMode.VECTOR)
    candidates = await exact.index.candidates(request, query.astype(np.float32))

    assert len(rows) == 3 * CHUNKS_PER_DOCUMENT
    assert [(c.chunk_id, c.text) for c in candidates.vector] == [
        (r["chunk_id"], r["text"]) for r in expected
    ]
    assert [c.score for c in candidates.vector] == pytest.approx(
        [1 - distance(r["embedding"]) for r in expected], abs=1e-5
    )


async def test_the_largest_entry_the_index_holds_fits(conn: asyncpg.Connection[Any]) -> None:
    # The migration's arithmetic: 512 dimensions beside the longest tenant id and model name
    # the code admits, a chunk id longer than the pipeline's and a long strategy name.
    tenant = "t" + "x" * 62
    model = "m" * 200
    await add_tenant(conn, tenant, "standard")
    document_id = await add_document(conn, tenant, title="Widest", read=("group:all",))
    await conn.execute(
        "INSERT INTO document_version (tenant_id, document_id, version_number, content,"
        " media_type, sha256, size_bytes, status)"
        " VALUES ($1, $2, 1, 'x', 'text/plain', $3, 1, 'PUBLISHED')",
        tenant,
        document_id,
        hashlib.sha256(b"x").digest(),
    )
    for dimension in (512, 513, 1536):
        await conn.execute(
            "INSERT INTO knowledge_chunk (tenant_id, document_id, version_number,"
            " embedding_model, chunk_id, ordinal, heading_path, text, content_digest,"
            " embedding_dimension, embedding, chunking_strategy)"
            " VALUES ($1, $2, 1, $3, $4, 0, '{}', 'x', '\\x00', $5, $6::text::vector, $7)",
            tenant,
            document_id,
            f"{model[:-4]}{dimension:04d}",
            "c" * 64,
            dimension,
            "[" + ",".join(["0.5"] * dimension) + "]",
            "heading-aware:max=512:overlap=64:tok=" + "k" * 80,
        )
    stored = await conn.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE tenant_id = $1", tenant
    )
    assert stored == 3
