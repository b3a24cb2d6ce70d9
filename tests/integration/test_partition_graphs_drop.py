"""`kb index partition-graphs drop` (services/indexer/maintenance/partition_graphs.py): the
way off the partition graphs for a deployment that has them -- refused while a large tenant
has no graph of its own, and while the indexers would build them again (real PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from services.index.ann import (
    ann_index_name,
    create_partition_ann_index_sql,
    partition_ann_index_name,
)
from services.index.generation import IndexGeneration
from services.indexer.maintenance.partition_graphs import PgPartitionGraphs
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.sink.pgvector import PartitionedDrop, PgVectorSink
from services.indexer.sink.tenant_graphs import QUERIES as GRAPH_QUERIES
from services.runtime.errors import DatabaseBusy
from services.runtime.pg.db import create_pool_without_session_reset
from services.runtime.settings import RuntimeSettings
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Candidates, Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings, VectorPath
from tests.integration.test_tenant_graphs import LARGE, add_corpus, ensure
from tests.support.cli import kb_async
from tests.support.search import (
    STRATEGY,
    SearchHarness,
    partition_graph_indexes,
    search_harness,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    """A deployment whose indexers ran with KB_INDEXER_PARTITION_GRAPHS on."""
    async with search_harness(settings, partition_graphs=True) as harness:
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
    return await partition_graph_indexes(conn, api.embedder.model)


def searching(
    api: SearchHarness, tenant: str, exact_max_chunks: int
) -> tuple[PgSearchIndex, SearchRequest]:
    index = PgSearchIndex(
        api.pool,
        Generation(api.embedder.model, api.embedder.dimension),
        SearchSettings(search_exact_max_chunks=exact_max_chunks, search_path_cache_seconds=0),
    )
    return index, SearchRequest(tenant, "policy refunds", ("group:all",), 10, SearchMode.HYBRID)


async def search(api: SearchHarness, tenant: str, exact_max_chunks: int = 50) -> Candidates:
    index, request = searching(api, tenant, exact_max_chunks)
    return await index.candidates(request, api.embedder.embed_sync(["policy refunds"])[0])


async def vector_path(api: SearchHarness, tenant: str, exact_max_chunks: int = 50) -> VectorPath:
    """The path the tenant's vector list takes (50: under both tenants' chunks)."""
    index, request = searching(api, tenant, exact_max_chunks)
    async with (
        api.pool.acquire() as conn,
        conn.transaction(readonly=True, isolation="repeatable_read"),
    ):
        return await index.vector_path(conn, request)


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
    assert await vector_path(api, "acme") is VectorPath.ANN
    assert await vector_path(api, neighbour) is VectorPath.EXACT
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


@pytest.mark.parametrize(
    "lock",
    [GRAPH_QUERIES["try_tenant_graphs_lock"], SINK_QUERIES["try_generation_lock"]],
    ids=["tenant-graphs", "generation"],
)
async def test_another_process_building_the_models_graphs_makes_it_exit_1_at_once(
    api: SearchHarness, conn: asyncpg.Connection[Any], env: dict[str, str], lock: str
) -> None:
    """A second session holding one of the model's locks (a tenant-graphs round, an indexer
    building the partitioned index): tried, never waited for; nothing checked or dropped."""
    await add_corpus(conn, api)
    assert await ensure(api) == ["acme"]
    parts = await partition_graph(conn, api)
    assert await conn.fetchval(lock, api.embedder.model)

    result = await drop(env)

    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "another process is building its graphs" in result.stderr
    assert await partition_graph(conn, api) == parts


async def test_each_try_is_bounded_by_a_statement_timeout_twice_its_lock_timeout(
    conn: asyncpg.Connection[Any],
) -> None:
    statement_timeout = await conn.fetchval("SHOW statement_timeout")
    async with conn.transaction():
        await conn.fetchrow(SINK_QUERIES["set_local_drop_timeouts"], "1500ms")
        assert await conn.fetchval("SHOW lock_timeout") == "1500ms"
        assert await conn.fetchval("SHOW statement_timeout") == "3s"
    assert await conn.fetchval("SHOW lock_timeout") == "0"
    assert await conn.fetchval("SHOW statement_timeout") == statement_timeout


async def drop_blocked_by(
    conn: asyncpg.Connection[Any], blocker: int, *, started_after: datetime | None = None
) -> asyncpg.Record:
    """The DROP INDEX waiting on ``blocker``'s lock (at most 30 s), in a statement started
    after ``started_after`` when given: that backend and no other (a search of the pool
    queued behind it waits on a lock too)."""
    async with asyncio.timeout(30):
        while True:
            waiting = await conn.fetch(
                "SELECT pid, query_start FROM pg_stat_activity"
                " WHERE datname = current_database() AND query LIKE 'DROP INDEX%'"
                "   AND $1 = ANY (pg_blocking_pids(pid))"
                "   AND ($2::timestamptz IS NULL OR query_start > $2)",
                blocker,
                started_after,
            )
            if waiting:
                assert len(waiting) == 1
                row: asyncpg.Record = waiting[0]
                return row
            await asyncio.sleep(0.02)


async def test_a_cancelled_try_is_tried_again(
    api: SearchHarness, conn: asyncpg.Connection[Any], database_url: str
) -> None:
    """A try ended by its statement_timeout (a cancel) is one more try, as a lock timeout
    is: here the cancel comes from a second session while the DROP waits."""
    await add_corpus(conn, api)
    assert await ensure(api) == ["acme"]
    graphs = PgPartitionGraphs(api.pool, min_chunks=LARGE, dropping=PartitionedDrop("60s", 2, 0))
    reader = await asyncpg.connect(database_url)
    try:
        reading = reader.transaction()
        await reading.start()
        await reader.fetch("SELECT chunk_id FROM knowledge_chunk LIMIT 1")  # its lock, held
        dropping = asyncio.create_task(graphs.drop(api.embedder.model))
        first_try = await drop_blocked_by(conn, reader.get_server_pid())
        assert await conn.fetchval("SELECT pg_cancel_backend($1)", first_try["pid"])
        # The second try, waiting in turn.
        await drop_blocked_by(conn, reader.get_server_pid(), started_after=first_try["query_start"])
        await reading.rollback()
        assert (await asyncio.wait_for(dropping, timeout=30)).dropped
    finally:
        await reader.close()
    assert await partition_graph(conn, api) == 0


@pytest.fixture
async def graphless(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    """The model registered by an indexer with partition graphs off: no partitioned index."""
    async with search_harness(settings) as harness:
        await PgVectorSink(harness.pool).ensure_generation(
            IndexGeneration(harness.embedder.model, harness.embedder.dimension, STRATEGY)
        )
        yield harness


async def leave_an_unattached_part(conn: asyncpg.Connection[Any], api: SearchHarness) -> str:
    """acme's corpus and own graph, and what a build interrupted before its parent, or its
    ATTACH, leaves: a part of the model's index on acme's partition, of no index; the
    partition's name."""
    partition = await add_corpus(conn, api)
    assert await ensure(api) == ["acme"]
    await conn.execute(
        create_partition_ann_index_sql(
            api.embedder.model, api.embedder.dimension, partition, concurrently=False
        )
    )
    return partition


async def test_parts_left_unattached_by_an_interrupted_build_are_dropped_and_reported(
    graphless: SearchHarness, conn: asyncpg.Connection[Any], env: dict[str, str]
) -> None:
    api = graphless
    model = api.embedder.model
    partition = await leave_an_unattached_part(conn, api)
    assert await partition_graph(conn, api) == 1

    result = await drop(env)

    assert result.returncode == 0, result.stderr
    part = partition_ann_index_name(model, partition)
    assert result.stdout == f"dropped  {model}  {part}  (unattached part)\n"
    assert f"partition graphs of {model}: dropped, 1 unattached parts" in result.stderr
    assert await partition_graph(conn, api) == 0
    assert await vector_path(api, "acme") is VectorPath.ANN


async def test_only_the_models_parts_are_dropped_not_a_reindex_leftover(
    graphless: SearchHarness, conn: asyncpg.Connection[Any], env: dict[str, str]
) -> None:
    """A REINDEX CONCURRENTLY interrupted leaves <part>_ccnew: it is no part of the model's
    index, whatever LIKE says, and stays."""
    api = graphless
    model = api.embedder.model
    partition = await leave_an_unattached_part(conn, api)
    part = partition_ann_index_name(model, partition)
    await conn.execute(f"CREATE INDEX {part}_ccnew ON {partition} (chunk_id)")

    result = await drop(env)

    assert result.returncode == 0, result.stderr
    assert result.stdout == f"dropped  {model}  {part}  (unattached part)\n"
    assert await conn.fetchval("SELECT to_regclass($1) IS NULL", part)
    assert await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{part}_ccnew")


async def test_a_part_waiting_past_the_lock_timeout_exits_1_and_the_session_is_set_back(
    graphless: SearchHarness,
    conn: asyncpg.Connection[Any],
    database_url: str,
    settings: RuntimeSettings,
) -> None:
    """DROP INDEX CONCURRENTLY of a part waits for the transactions on its partition while
    the command holds the model's locks: bounded by the parent drop's lock_timeout, which
    the session (its pool resets nothing) has as before afterwards."""
    api = graphless
    model, dimension = api.embedder.model, api.embedder.dimension
    partition = await add_corpus(conn, api)
    assert await ensure(api) == ["acme"]
    await conn.execute(
        create_partition_ann_index_sql(model, dimension, partition, concurrently=False)
    )
    pool = await create_pool_without_session_reset(settings, min_size=1, max_size=1)
    reader = await asyncpg.connect(database_url)
    try:
        before = await pool.fetchrow(
            "SELECT current_setting('lock_timeout') AS lock_timeout,"
            " current_setting('statement_timeout') AS statement_timeout"
        )
        graphs = PgPartitionGraphs(pool, min_chunks=LARGE, dropping=PartitionedDrop("100ms", 1, 0))
        async with reader.transaction():
            await reader.fetch(f"SELECT chunk_id FROM {partition} LIMIT 1")  # its lock, held
            with pytest.raises(DatabaseBusy, match="partition-graphs drop` again"):
                await graphs.drop(model)
        after = await pool.fetchrow(
            "SELECT current_setting('lock_timeout') AS lock_timeout,"
            " current_setting('statement_timeout') AS statement_timeout"
        )
        assert after == before
        assert await partition_graph(conn, api) == 1

        assert (await graphs.drop(model)).leftovers == (partition_ann_index_name(model, partition),)
        assert await partition_graph(conn, api) == 0
    finally:
        await reader.close()
        await pool.close()


async def test_the_models_of_live_generations_are_dropped_too(
    api: SearchHarness, conn: asyncpg.Connection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens, state) VALUES"
        " ('default', 'live-model', 8, 96, 0, 'ACTIVE'),"
        " ('default', 'retired-model', 8, 96, 0, 'RETIRED')"
    )
    graphs = PgPartitionGraphs(api.pool, min_chunks=LARGE)
    assert await graphs.models() == sorted([api.embedder.model, "live-model"])
