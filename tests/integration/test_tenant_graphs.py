"""A large tenant's own HNSW graph (services/indexer/sink/tenant_graphs.py): built for
tenants past the size, once, rebuilt when left INVALID, by one process at a time; search walks it
with its own ef_search (real PostgreSQL, migrations/0014's partitions)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import structlog

from services.embedding.hashing import HashingEmbedder
from services.index.ann import HNSW_MAX_DIMENSION, partition_ann_index_name, tenant_ann_index_name
from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.sink.tenant_graphs import QUERIES as GRAPH_QUERIES
from services.indexer.sink.tenant_graphs import PgTenantGraphs
from services.runtime.settings import RuntimeSettings
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings, VectorPath
from tests.support.api import add_tenant
from tests.support.cli import kb
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.search import (
    STRATEGY,
    ChunkSpec,
    SearchHarness,
    add_document,
    add_version,
    create_ann_index,
    partition_graph_indexes,
    point_search_at,
    search_harness,
)

pytestmark = pytest.mark.integration

CHUNKS_PER_DOCUMENT = 10
LARGE = 20 * CHUNKS_PER_DOCUMENT  # acme's chunks: the graph threshold
PARTITION_EF_SEARCH = 40
TENANT_EF_SEARCH = 123


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings) as harness:
        await create_ann_index(harness.pool, harness.embedder.model, harness.embedder.dimension)
        yield harness


async def add_documents(
    conn: asyncpg.Connection[Any],
    api: SearchHarness,
    tenant: str,
    documents: int,
    embedder: HashingEmbedder | None = None,
) -> None:
    """``documents`` of 10 chunks each, served by ``embedder``'s model (default: api's)."""
    embedder = embedder or api.embedder
    await add_tenant(conn, tenant, "standard")
    for n in range(documents):
        document_id = await add_document(conn, tenant, title=f"Doc {n}", read=("group:all",))
        chunks = [ChunkSpec(f"clause {c} of {tenant} policy {n}") for c in range(10)]
        await add_version(conn, tenant, document_id, 1, chunks, embedder)
        await point_search_at(conn, tenant, document_id, 1, embedder.model)


async def same_partition_as(conn: asyncpg.Connection[Any], tenant: str) -> str:
    """A tenant id that hashes to ``tenant``'s partition of knowledge_chunk (32 of them)."""
    remainder = await conn.fetchval(
        "SELECT r FROM generate_series(0, 31) r"
        " WHERE satisfies_hash_partition('knowledge_chunk'::regclass, 32, r, $1::text)",
        tenant,
    )
    for n in range(10_000):
        candidate = f"neighbour-{n}"
        if await conn.fetchval(
            "SELECT satisfies_hash_partition('knowledge_chunk'::regclass, 32, $1, $2::text)",
            remainder,
            candidate,
        ):
            return candidate
    raise AssertionError("no tenant id hashes to that partition")


@pytest.fixture
async def graphless(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    """The model's generation as an indexer with KB_INDEXER_PARTITION_GRAPHS off (the
    default) registers it: no partitioned index."""
    async with search_harness(settings) as harness:
        await PgVectorSink(harness.pool).ensure_generation(
            IndexGeneration(harness.embedder.model, harness.embedder.dimension, STRATEGY)
        )
        yield harness


@pytest.fixture
async def corpus(api: SearchHarness, conn: asyncpg.Connection[Any]) -> str:
    return await add_corpus(conn, api)


async def add_corpus(conn: asyncpg.Connection[Any], api: SearchHarness) -> str:
    """acme (200 chunks) shares its partition with a smaller neighbour (100); "small" has
    10. Returns acme's partition."""
    await add_documents(conn, api, "acme", LARGE // CHUNKS_PER_DOCUMENT)
    await add_documents(conn, api, await same_partition_as(conn, "acme"), 10)
    await add_documents(conn, api, "small", 1)
    await conn.execute("ANALYZE")
    partition: str = await conn.fetchval(
        "SELECT tableoid::regclass::text FROM knowledge_chunk WHERE tenant_id = 'acme' LIMIT 1"
    )
    return partition


def graphs_of(api: SearchHarness, min_chunks: int = LARGE) -> PgTenantGraphs:
    return PgTenantGraphs(api.pool, min_chunks=min_chunks)


async def ensure(api: SearchHarness, min_chunks: int = LARGE) -> list[str] | None:
    return await graphs_of(api, min_chunks).ensure(api.embedder.model, api.embedder.dimension)


async def graph_of(conn: asyncpg.Connection[Any], api: SearchHarness, tenant: str) -> Any:
    return await conn.fetchrow(
        "SELECT i.indisvalid AS valid, t.relname AS partition,"
        "       pg_get_indexdef(i.indexrelid) AS definition"
        "  FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid"
        "  JOIN pg_class t ON t.oid = i.indrelid WHERE c.relname = $1",
        tenant_ann_index_name(api.embedder.model, tenant),
    )


async def vector_list_of(api: SearchHarness) -> tuple[VectorPath, str, list[str]]:
    """acme's vector list: its path, the transaction's ef_search after the path is chosen,
    and the indexes its plan scans."""
    index = PgSearchIndex(
        api.pool,
        Generation(api.embedder.model, api.embedder.dimension),
        SearchSettings(
            search_exact_max_chunks=0,
            search_ef_search=PARTITION_EF_SEARCH,
            search_tenant_graph_ef_search=TENANT_EF_SEARCH,
        ),
    )
    request = SearchRequest("acme", "refunds", ("group:all",), 10, SearchMode.VECTOR)
    vector = api.embedder.embed_sync(["refunds"])[0]
    async with (
        api.pool.acquire() as conn,
        conn.transaction(readonly=True, isolation="repeatable_read"),
    ):
        path = await index.vector_path(conn, request)
        ef_search = await conn.fetchval("SELECT current_setting('hnsw.ef_search')")
        plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + index.vector_statement(path),
            "acme",
            ["group:all"],
            None,
            None,
            10,
            vector,
        )
    return path, ef_search, re.findall(r'"Index Name": "([^"]+)"', json.dumps(json.loads(plan)))


async def test_a_tenant_past_the_size_gets_a_graph_of_its_own_on_its_partition(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any]
) -> None:
    assert await ensure(api) == ["acme"]
    graph = await graph_of(conn, api, "acme")
    assert graph["valid"]
    assert graph["partition"] == corpus
    assert "WHERE ((embedding_model = " in graph["definition"]
    assert "(tenant_id = 'acme'::text)" in graph["definition"]
    assert await graph_of(conn, api, "small") is None
    # Built once: the next round finds it.
    assert await ensure(api) == []


async def test_search_walks_the_tenants_graph_with_its_own_ef_search(
    api: SearchHarness, corpus: str
) -> None:
    path, ef_search, indexes = await vector_list_of(api)
    assert path is VectorPath.ANN
    assert ef_search == str(PARTITION_EF_SEARCH)
    assert partition_ann_index_name(api.embedder.model, corpus) in indexes

    await ensure(api)
    path, ef_search, indexes = await vector_list_of(api)
    assert path is VectorPath.ANN
    assert ef_search == str(TENANT_EF_SEARCH)
    assert indexes.count(tenant_ann_index_name(api.embedder.model, "acme")) == 1
    assert partition_ann_index_name(api.embedder.model, corpus) not in indexes


async def test_with_partition_graphs_off_a_large_tenant_gets_its_graph_and_search_walks_it(
    graphless: SearchHarness, conn: asyncpg.Connection[Any]
) -> None:
    api = graphless
    corpus = await add_corpus(conn, api)
    assert await partition_graph_indexes(conn, api.embedder.model) == 0
    # No graph to walk: ranked exactly, however many chunks are readable.
    path, _, indexes = await vector_list_of(api)
    assert path is VectorPath.EXACT

    assert await ensure(api) == ["acme"]
    assert (await graph_of(conn, api, "acme"))["partition"] == corpus
    path, ef_search, indexes = await vector_list_of(api)
    assert path is VectorPath.ANN
    assert ef_search == str(TENANT_EF_SEARCH)
    assert indexes.count(tenant_ann_index_name(api.embedder.model, "acme")) == 1
    assert await partition_graph_indexes(conn, api.embedder.model) == 0


async def test_an_invalid_graph_is_not_walked_and_is_built_again(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any]
) -> None:
    await ensure(api)
    # What an interrupted CREATE INDEX CONCURRENTLY leaves behind.
    await conn.execute(
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = to_regclass($1)",
        tenant_ann_index_name(api.embedder.model, "acme"),
    )
    _, ef_search, _ = await vector_list_of(api)
    assert ef_search == str(PARTITION_EF_SEARCH)

    assert await ensure(api) == ["acme"]
    assert (await graph_of(conn, api, "acme"))["valid"]
    _, ef_search, _ = await vector_list_of(api)
    assert ef_search == str(TENANT_EF_SEARCH)


async def test_one_process_builds_at_a_time_and_the_others_skip_the_round(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any]
) -> None:
    model = api.embedder.model
    assert await conn.fetchval(GRAPH_QUERIES["try_tenant_graphs_lock"], model)
    try:
        assert await ensure(api) is None
        assert await graph_of(conn, api, "acme") is None
    finally:
        await conn.fetchval(GRAPH_QUERIES["release_tenant_graphs_lock"], model)
    assert await ensure(api) == ["acme"]


async def test_no_graphs_when_the_size_is_zero(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any]
) -> None:
    assert await ensure(api, min_chunks=0) == []
    assert await graph_of(conn, api, "acme") is None


async def one_round(graphs: PgTenantGraphs) -> dict[str, list[str] | None]:
    """What the indexer's first round (``run``) built, the rounds stopped after it."""
    first_round: asyncio.Future[dict[str, list[str] | None]] = (
        asyncio.get_running_loop().create_future()
    )
    round_now = graphs.ensure_every_model

    async def observed() -> dict[str, list[str] | None]:
        built = await round_now()
        first_round.set_result(built)
        return built

    graphs.ensure_every_model = observed  # type: ignore[method-assign]
    stop = asyncio.Event()
    rounds = asyncio.create_task(graphs.run(stop, interval_seconds=3600))
    built = await asyncio.wait_for(first_round, timeout=30)
    # Stopping does not wait for the next round's hour.
    stop.set()
    await asyncio.wait_for(rounds, timeout=10)
    return built


async def test_the_indexers_round_builds_graphs_until_stopped(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any]
) -> None:
    assert await one_round(graphs_of(api)) == {api.embedder.model: ["acme"]}
    assert (await graph_of(conn, api, "acme"))["valid"]


async def test_the_indexers_round_gives_a_tenant_on_a_second_model_its_graph(
    graphless: SearchHarness, conn: asyncpg.Connection[Any]
) -> None:
    """A tenant switched to another model than the indexer's (`kb index generations
    switch`) may stay on it: the round covers every model served or live."""
    api = graphless
    second = HashingEmbedder(32)
    await PgVectorSink(api.pool).ensure_generation(
        IndexGeneration(second.model, second.dimension, STRATEGY)
    )
    await conn.execute(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens) VALUES ('default', $1, $2, 96, 0)",
        second.model,
        second.dimension,
    )
    await add_documents(conn, api, "small", 1)
    await add_documents(conn, api, "acme", LARGE // CHUNKS_PER_DOCUMENT, embedder=second)
    # A retired generation's model no pointer names any more is left out.
    await conn.execute(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens, state) VALUES ('default', 'gone', 8, 96, 0,"
        " 'RETIRED')"
    )

    # The indexer's own model has no tenant past the size: the round does not even try its
    # lock (held here), nor the live generation's one no pointer names.
    await conn.execute(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens) VALUES ('default', 'unserved', 8, 96, 0)"
    )
    assert await conn.fetchval(GRAPH_QUERIES["try_tenant_graphs_lock"], api.embedder.model)
    try:
        built = await one_round(graphs_of(api))
    finally:
        await conn.fetchval(GRAPH_QUERIES["release_tenant_graphs_lock"], api.embedder.model)

    assert built == {second.model: ["acme"]}
    valid = await conn.fetchval(
        "SELECT i.indisvalid FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid"
        " WHERE c.relname = $1",
        tenant_ann_index_name(second.model, "acme"),
    )
    assert valid is True


async def test_kb_index_tenant_graphs_builds_them_now(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any], service_env: dict[str, str]
) -> None:
    result = kb(service_env, "index", "tenant-graphs", "--min-chunks", str(LARGE))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"built  {api.embedder.model}  acme\n"
    assert f"tenant graphs of {api.embedder.model}: 1 built" in result.stderr
    assert (await graph_of(conn, api, "acme"))["valid"]


@pytest.mark.parametrize("size", ["0", "-5", "many"])
async def test_kb_index_tenant_graphs_refuses_a_size_that_is_not_positive(
    api: SearchHarness,
    corpus: str,
    conn: asyncpg.Connection[Any],
    service_env: dict[str, str],
    size: str,
) -> None:
    result = kb(service_env, "index", "tenant-graphs", "--min-chunks", size)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert "--min-chunks" in result.stderr
    assert await graph_of(conn, api, "acme") is None


async def test_stopping_cuts_a_build_short_and_the_next_round_builds_it_again(
    api: SearchHarness, corpus: str, conn: asyncpg.Connection[Any]
) -> None:
    # A transaction holding the partition's SHARE UPDATE EXCLUSIVE lock keeps CREATE INDEX
    # CONCURRENTLY waiting, as a build of a very large tenant would take its time.
    holding = conn.transaction()
    await holding.start()
    await conn.execute(f"LOCK TABLE {corpus} IN SHARE UPDATE EXCLUSIVE MODE")
    stop = asyncio.Event()
    rounds = asyncio.create_task(graphs_of(api).run(stop, interval_seconds=3600))
    await wait_until_blocked_on_a_lock(api.pool)
    stop.set()
    # Shutdown does not wait for the build.
    await asyncio.wait_for(rounds, timeout=10)
    await holding.rollback()
    graph = await graph_of(conn, api, "acme")
    assert graph is None or not graph["valid"]

    assert await ensure(api) == ["acme"]
    assert (await graph_of(conn, api, "acme"))["valid"]


async def give_a_chunk_another_dimension(
    conn: asyncpg.Connection[Any], api: SearchHarness, tenant: str
) -> None:
    """One of the tenant's chunks of the model gets an embedding of half its dimension: the
    build of the tenant's graph fails (the cast to the model's vector type), every time."""
    await conn.execute(
        "UPDATE knowledge_chunk SET embedding = array_fill(0.5, ARRAY[$1::int])::vector,"
        " embedding_dimension = $1"
        " WHERE chunk_id = (SELECT chunk_id FROM knowledge_chunk WHERE tenant_id = $2 LIMIT 1)",
        api.embedder.dimension // 2,
        tenant,
    )


async def test_one_tenants_failed_build_leaves_the_next_tenants_their_graphs(
    graphless: SearchHarness, conn: asyncpg.Connection[Any]
) -> None:
    """acme's build (the largest, built first) fails every round: one of its chunks holds an
    embedding of another dimension than the model's. Its neighbour still gets its graph."""
    api = graphless
    await add_corpus(conn, api)
    neighbour = await same_partition_as(conn, "acme")
    await give_a_chunk_another_dimension(conn, api, "acme")

    with structlog.testing.capture_logs() as logs:
        built = await one_round(graphs_of(api, min_chunks=LARGE // 2))

    assert built == {api.embedder.model: [neighbour]}
    assert (await graph_of(conn, api, neighbour))["valid"]
    failed = [entry for entry in logs if entry["event"] == "tenant_graph.build_failed"]
    assert [(entry["tenant_id"], entry["model"]) for entry in failed] == [
        ("acme", api.embedder.model)
    ]
    assert failed[0]["code"] == "DATABASE_ERROR"
    assert failed[0]["sqlstate"] is not None
    # The INVALID index the failed build left is not kept up by acme's inserts till the next.
    assert await graph_of(conn, api, "acme") is None


async def test_kb_index_tenant_graphs_exits_1_naming_a_tenant_whose_build_failed(
    graphless: SearchHarness, conn: asyncpg.Connection[Any], service_env: dict[str, str]
) -> None:
    api = graphless
    await add_corpus(conn, api)
    neighbour = await same_partition_as(conn, "acme")
    await give_a_chunk_another_dimension(conn, api, "acme")

    result = kb(service_env, "index", "tenant-graphs", "--min-chunks", str(LARGE // 2))

    assert result.returncode == 1, result.stderr
    assert result.stdout == f"built  {api.embedder.model}  {neighbour}\n"
    assert f"tenant graphs of {api.embedder.model}: 1 tenants still have none (acme)" in (
        result.stderr
    )


async def test_a_model_of_more_dimensions_than_hnsw_takes_gets_no_graph(
    graphless: SearchHarness, conn: asyncpg.Connection[Any]
) -> None:
    """pgvector's HNSW refuses a vector over 2,000 dimensions: no build is tried (it would
    leave an INVALID index, dropped and built again every round), one warning a round."""
    api = graphless
    wide = HashingEmbedder(HNSW_MAX_DIMENSION + 1)
    # A retired generation of the model once had another dimension: not the one read.
    for dimension, state in ((64, "RETIRED"), (wide.dimension, "ACTIVE")):
        await conn.execute(
            "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
            " chunk_max_tokens, chunk_overlap_tokens, state)"
            " VALUES ('default', $1, $2, 96, 0, $3)",
            wide.model,
            dimension,
            state,
        )
    await add_documents(conn, api, "acme", LARGE // CHUNKS_PER_DOCUMENT, embedder=wide)

    with structlog.testing.capture_logs() as logs:
        built = await one_round(graphs_of(api))

    assert built == {wide.model: []}
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM pg_class WHERE relname = $1",
            tenant_ann_index_name(wide.model, "acme"),
        )
        == 0
    )
    warned = [entry for entry in logs if entry["event"] == "tenant_graph.dimension_unsupported"]
    assert [(entry["model"], entry["dimension"]) for entry in warned] == [
        (wide.model, wide.dimension)
    ]
    # Left without a graph by design, not by a failure: the drop and the CLI do not wait on it.
    assert await graphs_of(api).missing(wide.model) == []
