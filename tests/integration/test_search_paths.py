"""Which path the vector list takes, and that it is the path's plan: principals who may read
many chunks walk an HNSW graph (their tenant's own, or their tenant partition's) when there
is one, principals who may read few -- or many with no graph to walk -- get every readable
chunk ranked exactly (real PostgreSQL, migrations/0014's partitions)."""

from __future__ import annotations

import asyncio
import gc
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.index.ann import ann_index_name, partition_ann_index_name, tenant_ann_index_name
from services.indexer.sink.tenant_graphs import PgTenantGraphs
from services.runtime.settings import RuntimeSettings
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings, VectorPath
from tests.support.api import add_tenant
from tests.support.search import (
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
EXACT_MAX_CHUNKS = 100  # "few": one document (10 chunks); "many": all 400


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings, partition_graphs=True) as harness:
        yield harness


def search_index(
    api: SearchHarness,
    settings: RuntimeSettings,
    exact_max_chunks: int = EXACT_MAX_CHUNKS,
    cache_seconds: float | None = None,
) -> PgSearchIndex:
    """The harness's search index with the test's thresholds (cache: the default, or
    ``cache_seconds``)."""
    search = SearchSettings(
        database_url=settings.database_url, search_exact_max_chunks=exact_max_chunks
    )
    if cache_seconds is not None:
        search = search.model_copy(update={"search_path_cache_seconds": cache_seconds})
    return PgSearchIndex(api.pool, Generation(api.embedder.model, api.embedder.dimension), search)


@pytest.fixture
async def index(api: SearchHarness, settings: RuntimeSettings) -> PgSearchIndex:
    return search_index(api, settings)


@pytest.fixture
async def corpus(api: SearchHarness, conn: asyncpg.Connection[Any]) -> str:
    await add_tenant(conn, "acme", "standard")
    for n in range(DOCUMENTS):
        read = ("group:many", "group:few") if n == 0 else ("group:many",)
        document_id = await add_document(conn, "acme", title=f"Doc {n}", read=read)
        chunks = [
            ChunkSpec(f"clause {c} of policy {n} on refunds") for c in range(CHUNKS_PER_DOCUMENT)
        ]
        await add_version(conn, "acme", document_id, 1, chunks, api.embedder)
        await point_search_at(conn, "acme", document_id, 1, api.embedder.model)
    await conn.execute("ANALYZE")
    partition: str = await conn.fetchval(
        "SELECT tableoid::regclass::text FROM knowledge_chunk WHERE tenant_id = 'acme' LIMIT 1"
    )
    return partition


async def plan_of(
    index: PgSearchIndex, api: SearchHarness, principal: str
) -> tuple[VectorPath, list[str]]:
    """The path search chooses for ``principal`` and the indexes its vector list scans."""
    path, plan = await explain(index, api, principal)
    return path, re.findall(r'"Index Name": "([^"]+)"', json.dumps(plan))


def node_types(plan: Any) -> list[str]:
    return re.findall(r'"Node Type": "([^"]+)"', json.dumps(plan))


def plan_nodes(plan: Any) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, depth first."""
    nodes: list[dict[str, Any]] = []
    pending = [entry["Plan"] for entry in plan]
    while pending:
        node = pending.pop()
        nodes.append(node)
        pending.extend(node.get("Plans", []))
    return nodes


async def explain(
    index: PgSearchIndex, api: SearchHarness, principal: str
) -> tuple[VectorPath, Any]:
    """The path search chooses for ``principal`` and its vector list's plan."""
    request = SearchRequest("acme", "refunds", (principal,), 10, SearchMode.VECTOR)
    vector = api.embedder.embed_sync(["refunds"])[0]
    async with (
        api.pool.acquire() as conn,
        conn.transaction(readonly=True, isolation="repeatable_read"),
    ):
        path = await index.vector_path(conn, request)
        plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + index.vector_statement(path),
            "acme",
            [principal],
            None,
            None,
            10,
            vector,
        )
    return path, json.loads(plan)


async def test_many_readable_chunks_walk_the_tenant_partitions_graph(
    api: SearchHarness, index: PgSearchIndex, corpus: str
) -> None:
    path, indexes = await plan_of(index, api, "group:many")
    assert path is VectorPath.ANN
    assert partition_ann_index_name(api.embedder.model, corpus) in indexes
    # Every result is readable and of the tenant, as on the exact path.
    request = SearchRequest("acme", "refunds", ("group:many",), 10, SearchMode.VECTOR)
    candidates = await index.candidates(request, api.embedder.embed_sync(["refunds"])[0])
    assert len(candidates.vector) == 10


async def test_many_readable_chunks_walk_a_graph_only_when_there_is_one(
    api: SearchHarness, settings: RuntimeSettings, conn: asyncpg.Connection[Any], corpus: str
) -> None:
    """ANN's settings (sorting off, no materialize) make a graphless plan slow: with neither
    the partition's graph nor the tenant's own, many readable chunks are ranked exactly."""
    model = api.embedder.model
    counting = search_index(api, settings, cache_seconds=0)
    exact = search_index(api, settings, 10_000_000, cache_seconds=0)
    request = SearchRequest("acme", "refunds", ("group:many",), 10, SearchMode.HYBRID)
    vector = api.embedder.embed_sync(["refunds"])[0]

    # The partition graph only (KB_INDEXER_PARTITION_GRAPHS on).
    path, indexes = await plan_of(counting, api, "group:many")
    assert path is VectorPath.ANN
    assert partition_ann_index_name(model, corpus) in indexes

    # Neither graph: the vector list exact, and the very list of exact ranking; the keyword
    # list still probes each candidate, as for any principal who reads this much.
    await conn.execute(f"DROP INDEX {ann_index_name(model)}")
    path, indexes = await plan_of(counting, api, "group:many")
    assert path is VectorPath.EXACT
    assert not [name for name in indexes if name.startswith("knowledge_chunk_ann_")]
    keyword_paths = KeywordPaths(counting._keyword_sql)
    counting._keyword_sql = keyword_paths
    graphless = await counting.candidates(request, vector)
    assert keyword_paths.read == [VectorPath.ANN]
    assert len({c.document_id for c in graphless.vector}) > 1
    assert graphless == await exact.candidates(request, vector)

    # The tenant's own graph only.
    assert await PgTenantGraphs(api.pool, min_chunks=1).ensure(model, api.embedder.dimension) == [
        "acme"
    ]
    path, indexes = await plan_of(counting, api, "group:many")
    assert path is VectorPath.ANN
    assert indexes.count(tenant_ann_index_name(model, "acme")) == 1


class KeywordPaths(dict[Any, str]):
    """A search index's keyword statements, noting the path of each one a search reads."""

    def __init__(self, statements: Any) -> None:
        super().__init__(statements)
        self.read: list[VectorPath] = []

    def __getitem__(self, key: Any) -> str:
        self.read.append(key[0])
        return super().__getitem__(key)


async def test_a_kept_graphless_choice_still_gives_the_keyword_list_the_probing_plan(
    api: SearchHarness, settings: RuntimeSettings, conn: asyncpg.Connection[Any], corpus: str
) -> None:
    """With the choice kept, hybrid and keyword-only searches read it instead of counting:
    they too must give the keyword list the count's plan, not the vector list's path."""
    model = api.embedder.model
    await conn.execute(f"DROP INDEX {ann_index_name(model)}")
    index = search_index(api, settings, cache_seconds=300)
    keyword_paths = KeywordPaths(index._keyword_sql)
    index._keyword_sql = keyword_paths
    hybrid = SearchRequest("acme", "refunds", ("group:many",), 10, SearchMode.HYBRID)
    vector = api.embedder.embed_sync(["refunds"])[0]
    first = await index.candidates(hybrid, vector)  # counts, and keeps the choice
    kept = index._paths.kept(hybrid)
    assert kept is not None
    assert (kept.path, kept.keyword_path) == (VectorPath.EXACT, VectorPath.ANN)
    assert await index.candidates(hybrid, vector) == first  # the kept choice
    keyword = SearchRequest("acme", "refunds", ("group:many",), 10, SearchMode.KEYWORD)
    await index.candidates(keyword, None)
    assert keyword_paths.read == [VectorPath.ANN] * 3


async def test_the_ann_path_probes_each_candidates_pointer_and_acl_rows(
    api: SearchHarness, index: PgSearchIndex, corpus: str
) -> None:
    # The graph yields candidates in distance order; each is checked by index probes as it
    # comes. Collecting the readable documents first (hashed, merged, or materialized and
    # scanned again per candidate) costs what the tenant's size costs, before the first row.
    path, plan = await explain(index, api, "group:many")
    assert path is VectorPath.ANN
    nodes = set(node_types(plan))
    assert "Nested Loop" in nodes
    assert not {"Materialize", "Hash", "Hash Join", "Merge Join", "HashAggregate"} & nodes


async def test_few_readable_chunks_are_ranked_exactly(
    api: SearchHarness, index: PgSearchIndex, corpus: str
) -> None:
    path, indexes = await plan_of(index, api, "group:few")
    assert path is VectorPath.EXACT
    assert not [name for name in indexes if name.startswith("knowledge_chunk_ann_")]
    request = SearchRequest("acme", "refunds", ("group:few",), 10, SearchMode.VECTOR)
    candidates = await index.candidates(request, api.embedder.embed_sync(["refunds"])[0])
    assert len(candidates.vector) == CHUNKS_PER_DOCUMENT
    assert len({c.document_id for c in candidates.vector}) == 1


async def test_the_exact_path_lists_the_readable_documents_pointers_in_one_scan(
    api: SearchHarness, index: PgSearchIndex, corpus: str
) -> None:
    # Few readable documents: their ids (from the ACL) go into one scan of the pointers'
    # covering index (migrations/0016), not a primary-key probe per document, nor every
    # pointer of the tenant read and hashed (the planner misjudges how many are read).
    path, plan = await explain(index, api, "group:few")
    assert path is VectorPath.EXACT
    nodes = set(node_types(plan))
    assert "Nested Loop" in nodes
    assert not {"Hash Join", "Merge Join", "Bitmap Heap Scan"} & nodes
    pointer_scans = [
        (node["Node Type"], node["Index Name"])
        for node in plan_nodes(plan)
        if node.get("Relation Name") == "document_search_version"
    ]
    assert pointer_scans == [("Index Only Scan", "document_search_version_current")]
    # The ACL is read once, for the list (an InitPlan), not probed per document or chunk.
    acl_reads = [
        node.get("Parent Relationship")
        for node in plan_nodes(plan)
        if node.get("Relation Name") == "document_acl"
    ]
    assert acl_reads == ["InitPlan"]


async def test_a_tenant_without_chunks_has_empty_lists_in_every_mode(
    api: SearchHarness, index: PgSearchIndex, conn: asyncpg.Connection[Any], corpus: str
) -> None:
    await add_tenant(conn, "globex", "standard")
    await add_document(conn, "globex", title="Unindexed", read=("group:few",))
    for mode in SearchMode:
        request = SearchRequest("globex", "refunds", ("group:few",), 10, mode)
        candidates = await index.candidates(request, api.embedder.embed_sync(["refunds"])[0])
        assert candidates.vector == []
        assert candidates.keyword == []


async def test_a_kept_path_only_decides_speed_the_acl_is_read_by_every_search(
    api: SearchHarness, conn: asyncpg.Connection[Any], settings: RuntimeSettings, corpus: str
) -> None:
    generation = Generation(api.embedder.model, api.embedder.dimension)

    def searcher(path_cache_seconds: float, exact_max_chunks: int) -> PgSearchIndex:
        return PgSearchIndex(
            api.pool,
            generation,
            SearchSettings(
                database_url=settings.database_url,
                search_exact_max_chunks=exact_max_chunks,
                search_path_cache_seconds=path_cache_seconds,
            ),
        )

    keeping, counting = searcher(3600, EXACT_MAX_CHUNKS), searcher(0, EXACT_MAX_CHUNKS)
    assert (await explain(keeping, api, "group:few"))[0] is VectorPath.EXACT
    # group:few now may read every document: more than EXACT_MAX_CHUNKS chunks.
    await conn.execute(
        "INSERT INTO document_acl (tenant_id, document_id, principal, permission)"
        " SELECT tenant_id, document_id, 'group:few', 'READ' FROM document"
        " WHERE tenant_id = 'acme' ON CONFLICT DO NOTHING"
    )
    assert (await explain(keeping, api, "group:few"))[0] is VectorPath.EXACT  # kept
    assert (await explain(counting, api, "group:few"))[0] is VectorPath.ANN
    request = SearchRequest("acme", "refunds", ("group:few",), 10, SearchMode.HYBRID)
    vector = api.embedder.embed_sync(["refunds"])[0]
    kept = await keeping.candidates(request, vector)
    # The kept (exact) path ranks what the principal may read now: every document.
    assert kept == await searcher(0, 10_000_000).candidates(request, vector)
    assert len({c.document_id for c in kept.vector}) > 1
    # And a revoked grant is gone at once, whatever path is kept.
    await conn.execute("DELETE FROM document_acl WHERE principal = 'group:few'")
    emptied = await keeping.candidates(request, vector)
    assert emptied.vector == []
    assert emptied.keyword == []


async def test_keyword_search_follows_a_kept_path_with_the_same_answer(
    api: SearchHarness, index: PgSearchIndex, corpus: str
) -> None:
    # Keyword search alone does not count the path; once a vector search of the same
    # principals has kept ANN, its list probes each match instead of starting from the
    # readable documents -- another plan, the same list.
    keyword = SearchRequest("acme", "clause policy", ("group:many",), 10, SearchMode.KEYWORD)
    joined = await index.candidates(keyword, None)
    vector = SearchRequest("acme", "refunds", ("group:many",), 10, SearchMode.VECTOR)
    await index.candidates(vector, api.embedder.embed_sync(["refunds"])[0])
    kept = index._paths.kept(keyword)
    assert kept is not None
    assert kept.path is VectorPath.ANN
    probed = await index.candidates(keyword, None)
    assert len(joined.keyword) == 10
    assert probed == joined


async def test_no_readable_chunk_is_the_exact_path_and_an_empty_list(
    api: SearchHarness, index: PgSearchIndex, corpus: str
) -> None:
    path, _ = await plan_of(index, api, "group:nobody")
    assert path is VectorPath.EXACT
    request = SearchRequest("acme", "refunds", ("group:nobody",), 10, SearchMode.HYBRID)
    candidates = await index.candidates(request, api.embedder.embed_sync(["refunds"])[0])
    assert candidates.vector == []
    assert candidates.keyword == []


async def test_hybrid_reads_its_lists_on_one_connection_when_no_second_is_free(
    api: SearchHarness, corpus: str, settings: RuntimeSettings
) -> None:
    # Hybrid reads its two lists at once on two connections sharing one snapshot; with the
    # pool's only connection taken by the search itself, it reads them in turn instead of
    # waiting for a second (which would never come).
    from services.runtime.pg.db import create_pool

    pool = await create_pool(settings, min_size=1, max_size=1)
    try:
        generation = Generation(api.embedder.model, api.embedder.dimension)
        single = PgSearchIndex(pool, generation, SearchSettings(database_url=settings.database_url))
        wide = PgSearchIndex(
            api.pool, generation, SearchSettings(database_url=settings.database_url)
        )
        request = SearchRequest("acme", "refunds policy", ("group:many",), 10, SearchMode.HYBRID)
        vector = api.embedder.embed_sync(["refunds policy"])[0]
        alone = await single.candidates(request, vector)
        together = await wide.candidates(request, vector)
    finally:
        await pool.close()
    assert alone == together
    assert len(alone.vector) == 20
    assert len(alone.keyword) == 20


async def test_hybrid_without_an_idle_connection_reads_in_turn_and_grows_the_pool(
    api: SearchHarness, corpus: str, settings: RuntimeSettings
) -> None:
    # A pool that starts with one connection (KB_DB_POOL_MIN_SIZE's default): the first
    # hybrid search reads its lists in turn at once -- no connect started and cut short by
    # a timeout, which asyncpg reports as a never-retrieved ConnectionError -- and a second
    # connection is opened behind it for the next search.
    from services.runtime.pg.db import create_pool

    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    pool = await create_pool(settings, min_size=1, max_size=4)
    try:
        index = PgSearchIndex(
            pool,
            Generation(api.embedder.model, api.embedder.dimension),
            SearchSettings(database_url=settings.database_url),
        )
        request = SearchRequest("acme", "refunds policy", ("group:many",), 10, SearchMode.HYBRID)
        vector = api.embedder.embed_sync(["refunds policy"])[0]
        assert pool.get_size() == 1
        first = await index.candidates(request, vector)
        await index.ended()  # its connection back in the pool, and the pool grown
        assert pool.get_size() == 2
        assert pool.get_idle_size() == 2
        assert await index.candidates(request, vector) == first
        assert not index._connections.growing  # the second search found an idle connection
        gc.collect()
    finally:
        await pool.close()
        loop.set_exception_handler(previous)
    assert reported == []


def test_only_a_snapshot_id_goes_into_the_import_statement() -> None:
    from services.search.index_pg import import_snapshot_sql

    assert import_snapshot_sql("00000003-0000001B-1") == (
        "SET TRANSACTION SNAPSHOT '00000003-0000001B-1'"
    )
    for bad in ("", "1'; DROP TABLE tenant; --", "00000003-0000001B-1 ", "abc"):
        with pytest.raises(ValueError, match="not a snapshot id"):
            import_snapshot_sql(bad)
