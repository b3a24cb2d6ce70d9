"""`kb index partition-graphs drop` (services/indexer/maintenance/partition_graphs.py): the
way off the partition graphs for a deployment that has them -- refused while a large tenant
has no graph of its own, and while the indexers would build them again (real PostgreSQL)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from services.index.ann import ann_index_name
from services.indexer.maintenance.partition_graphs import PgPartitionGraphs
from services.indexer.sink.pgvector import PartitionedDrop
from services.runtime.errors import DatabaseBusy
from services.runtime.settings import RuntimeSettings
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Candidates, Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings
from tests.integration.test_tenant_graphs import LARGE, add_corpus, ensure
from tests.support.cli import kb_async
from tests.support.search import SearchHarness, create_ann_index, search_harness

pytestmark = pytest.mark.integration

# The model's partitioned index and its partitions' parts (not the tenants' graphs, _t...).
PARTITION_GRAPH = "SELECT count(*) FROM pg_class WHERE relname = $1 OR relname LIKE $1 || '\\_p%'"


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    """A deployment whose indexers ran with KB_INDEXER_PARTITION_GRAPHS on."""
    async with search_harness(settings) as harness:
        await create_ann_index(harness.pool, harness.embedder.model, harness.embedder.dimension)
        yield harness


@pytest.fixture
def env(service_env: dict[str, str]) -> dict[str, str]:
    return {**service_env, "KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS": str(LARGE)}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


async def drop(env: dict[str, str], *args: str) -> Run:
    # Not blocking the event loop: the pool's connections finish their searches' transactions
    # meanwhile (one left open would hold the lock the DROP waits for).
    return Run(*await kb_async(env, "index", "partition-graphs", "drop", *args))


async def partition_graph(conn: asyncpg.Connection[Any], api: SearchHarness) -> int:
    count: int = await conn.fetchval(PARTITION_GRAPH, ann_index_name(api.embedder.model))
    return count


async def search(api: SearchHarness, tenant: str, exact_max_chunks: int = 50) -> Candidates:
    index = PgSearchIndex(
        api.pool,
        Generation(api.embedder.model, api.embedder.dimension),
        SearchSettings(search_exact_max_chunks=exact_max_chunks, search_path_cache_seconds=0),
    )
    request = SearchRequest(tenant, "policy refunds", ("group:all",), 10, SearchMode.HYBRID)
    return await index.candidates(request, api.embedder.embed_sync(["policy refunds"])[0])


async def test_refused_while_a_large_tenant_has_no_graph_of_its_own(
    api: SearchHarness, conn: asyncpg.Connection[Any], env: dict[str, str]
) -> None:
    await add_corpus(conn, api)
    parts = await partition_graph(conn, api)
    assert parts > 1

    result = await drop(env)

    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "kept, 1 tenants of at least 200 chunks have no graph of their own (acme)" in (
        result.stderr
    )
    assert "kb index tenant-graphs" in result.stderr
    assert await partition_graph(conn, api) == parts


async def test_drops_once_every_large_tenant_has_its_graph_and_search_answers_the_same(
    api: SearchHarness, conn: asyncpg.Connection[Any], env: dict[str, str]
) -> None:
    await add_corpus(conn, api)
    neighbour: str = await conn.fetchval(
        "SELECT tenant_id FROM document_search_version GROUP BY tenant_id"
        " HAVING sum(chunk_count) = $1",
        LARGE // 2,
    )
    assert await ensure(api) == ["acme"]
    before = await search(api, "acme")
    assert before.vector

    result = await drop(env, "--model", api.embedder.model)

    assert result.returncode == 0, result.stderr
    index = ann_index_name(api.embedder.model)
    assert result.stdout == f"dropped  {api.embedder.model}  {index}\n"
    assert f"partition graphs of {api.embedder.model}: dropped" in result.stderr
    assert await partition_graph(conn, api) == 0
    # acme walks its own graph, as before; the neighbour (over the exact threshold, no graph
    # of its own) is ranked exactly now.
    assert await search(api, "acme") == before
    graphless = await search(api, neighbour)
    assert graphless.vector
    assert graphless == await search(api, neighbour, exact_max_chunks=10_000_000)

    again = await drop(env)
    assert again.returncode == 0, again.stderr
    assert again.stdout == ""
    assert f"partition graphs of {api.embedder.model}: none" in again.stderr


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"KB_INDEXER_PARTITION_GRAPHS": "true"}, "KB_INDEXER_PARTITION_GRAPHS"),
        ({"KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS": "0"}, "KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS"),
    ],
)
async def test_refused_with_exit_2_when_no_graph_would_be_walked_or_it_would_come_back(
    api: SearchHarness,
    conn: asyncpg.Connection[Any],
    env: dict[str, str],
    variables: dict[str, str],
    named: str,
) -> None:
    await add_corpus(conn, api)
    assert await ensure(api) == ["acme"]
    parts = await partition_graph(conn, api)

    result = await drop({**env, **variables})

    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert named in result.stderr
    assert "CONFIG_INVALID" in result.stderr
    assert await partition_graph(conn, api) == parts


async def test_a_model_name_that_is_no_model_is_bad_input(
    api: SearchHarness, conn: asyncpg.Connection[Any], env: dict[str, str]
) -> None:
    result = await drop(env, "--model", "no'model")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert await partition_graph(conn, api) > 0


async def test_a_long_transaction_on_the_table_makes_it_give_up_and_keep_the_index(
    api: SearchHarness, conn: asyncpg.Connection[Any], database_url: str
) -> None:
    """The DROP waits a short lock_timeout a few times, never long enough to hold every
    search up behind it; the index is there for the next run."""
    await add_corpus(conn, api)
    assert await ensure(api) == ["acme"]
    parts = await partition_graph(conn, api)
    graphs = PgPartitionGraphs(api.pool, min_chunks=LARGE, dropping=PartitionedDrop("100ms", 2, 0))
    reader = await asyncpg.connect(database_url)
    try:
        async with reader.transaction():
            await reader.fetch("SELECT chunk_id FROM knowledge_chunk LIMIT 1")  # its lock, held
            with pytest.raises(DatabaseBusy, match="partition-graphs drop` again"):
                await graphs.drop(api.embedder.model)
    finally:
        await reader.close()
    assert await partition_graph(conn, api) == parts

    assert (await graphs.drop(api.embedder.model)).dropped
    assert await partition_graph(conn, api) == 0
