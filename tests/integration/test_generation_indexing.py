"""The indexer's side of search generations (docs/architecture.md#index-generations), on real
PostgreSQL: the default registered at start, each task indexed by its generation's pipeline,
every completion recorded in document_generation_version, the search pointer moved only for
the tenant's serving generation, a generation built beside it collected against its own
version only (services/indexer/gc), a task of the serving generation that stopped serving
mid-flight completed into the generation it was resolved to without moving the pointer, and
a tenant's publishes claimed before its backfill."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import structlog

from services.embedding.batching import Batching
from services.embedding.hashing import HashingEmbedder
from services.index.generations import SearchGeneration
from services.indexer.gc.collector import GarbageCollector, GcRound
from services.indexer.gc.settings import GcSettings
from services.indexer.generations.build import pipeline_builder
from services.indexer.pipeline.generations import GenerationPipelines
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.source_pg import PgVersionSource
from services.indexer.pipeline.version_indexer import (
    PipelineIndexer,
    chunking_strategy,
    index_generation,
)
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.generations import TaskGenerations
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease
from tests.support.documents import make_large_text
from tests.support.tasks import CreatedTask, create_task
from tests.support.versions import publish_version

pytestmark = pytest.mark.integration

LEASE = 60.0
DEFAULT_MODEL = "hashing-v1-64"
OTHER_MODEL = "hashing-v1-32"


@contextlib.asynccontextmanager
async def generations_indexer(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch, **streaming: Any
) -> AsyncIterator[tuple[PipelineIndexer, SearchGeneration]]:
    """The indexer as `kb indexer run` wires it (wiring.pipeline_indexer), on the hashing
    embedder: the default generation registered, the others built by the real builder from
    the `default` profile (KB_EMBEDDING_PROVIDER=hashing)."""
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "hashing")
    embedder = HashingEmbedder(dimension=64)
    parse_pool = ParsePool(inline=True)  # ``streaming``: the pipeline's slice settings
    sink = PgVectorSink(pool)
    strategy = chunking_strategy(embedder, max_tokens=128)
    generation = index_generation(embedder, strategy)
    await sink.ensure_generation(generation)
    default = await sink.register_default(generation, chunk_max_tokens=128, chunk_overlap_tokens=0)
    indexer = PipelineIndexer(
        PgVersionSource(pool),
        parse_pool,
        embedder,
        sink,
        strategy=strategy,
        batching=Batching(batch_size=32),
        search=default,
        **streaming,
    )
    pipelines = GenerationPipelines(
        indexer.default,
        TaskGenerations(pool),
        pipeline_builder(pool, sink, owner="test"),
    )
    indexer.use_generations(pipelines)
    try:
        yield indexer, default
    finally:
        await pipelines.aclose()
        await parse_pool.aclose()
        await embedder.aclose()


async def add_generation(pool: asyncpg.Pool[Any], *, dimension: int = 32) -> int:
    generation_id: int = await pool.fetchval(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens)"
        " VALUES ('default', $1, $2, 96, 0) RETURNING generation_id",
        f"hashing-v1-{dimension}",
        dimension,
    )
    return generation_id


async def build_tenant_in(
    pool: asyncpg.Pool[Any], tenant_id: str, serving: int, beside: int
) -> None:
    """The tenant served by ``serving`` and built in ``beside`` too (what `create` leaves)."""
    await pool.execute(
        "INSERT INTO tenant_search_generation (tenant_id, generation_id, serving)"
        " VALUES ($1, $2, true), ($1, $3, false)",
        tenant_id,
        serving,
        beside,
    )


async def switch(pool: asyncpg.Pool[Any], tenant_id: str, to: int) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE tenant_search_generation SET serving = false WHERE tenant_id = $1", tenant_id
        )
        await conn.execute(
            "UPDATE tenant_search_generation SET serving = true"
            " WHERE tenant_id = $1 AND generation_id = $2",
            tenant_id,
            to,
        )


async def add_task(
    pool: asyncpg.Pool[Any],
    created: CreatedTask,
    version: int,
    generation_id: int | None,
    *,
    priority: int = 0,
    age_seconds: float = 0.0,
) -> uuid.UUID:
    task_id: uuid.UUID = await pool.fetchval(
        "INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier,"
        " generation_id, priority, next_attempt_at)"
        " VALUES (gen_random_uuid(), $1, $2, $3, $4, $5, $6,"
        "         now() - make_interval(secs => $7)) RETURNING task_id",
        created.tenant_id,
        created.document_id,
        version,
        created.tier,
        generation_id,
        priority,
        age_seconds,
    )
    return task_id


async def claim(queue: PgTaskQueue, task_id: uuid.UUID) -> Lease:
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert lease.task_id == task_id
    return lease


async def run(queue: PgTaskQueue, indexer: PipelineIndexer, task_id: uuid.UUID) -> Lease:
    lease = await claim(queue, task_id)
    outcome = await indexer.index(lease)
    await queue.complete(lease, in_transaction=outcome.write)
    return lease


async def pointer(pool: asyncpg.Pool[Any], created: CreatedTask) -> tuple[int, str] | None:
    row = await pool.fetchrow(
        "SELECT version_number, embedding_model FROM document_search_version"
        " WHERE tenant_id = $1 AND document_id = $2",
        created.tenant_id,
        created.document_id,
    )
    return None if row is None else (row["version_number"], row["embedding_model"])


async def built(pool: asyncpg.Pool[Any], created: CreatedTask) -> dict[int, tuple[int, int]]:
    """generation -> (version, chunk count) of the document's document_generation_version."""
    rows = await pool.fetch(
        "SELECT generation_id, version_number, chunk_count FROM document_generation_version"
        " WHERE tenant_id = $1 AND document_id = $2",
        created.tenant_id,
        created.document_id,
    )
    return {r["generation_id"]: (r["version_number"], r["chunk_count"]) for r in rows}


async def chunks(pool: asyncpg.Pool[Any], created: CreatedTask) -> dict[tuple[str, int], int]:
    """(model, version) -> chunks the document holds."""
    rows = await pool.fetch(
        "SELECT embedding_model, version_number, count(*)::int AS n FROM knowledge_chunk"
        " WHERE tenant_id = $1 AND document_id = $2 GROUP BY 1, 2",
        created.tenant_id,
        created.document_id,
    )
    return {(r["embedding_model"], r["version_number"]): r["n"] for r in rows}


async def collect(pool: asyncpg.Pool[Any]) -> GcRound:
    """A round of the collector of superseded chunks, keeping nothing below what is served."""
    collector = GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=1000))
    return await collector.collect(max_documents=100)


async def test_the_default_is_registered_once_with_its_chunk_settings(
    pool: asyncpg.Pool[Any],
) -> None:
    embedder = HashingEmbedder(dimension=64)
    generation = index_generation(embedder, chunking_strategy(embedder, max_tokens=128))
    sink = PgVectorSink(pool)
    other = await pool.fetchval(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens, is_default)"
        " VALUES ('default', 'hashing-v1-8', 8, 64, 0, true) RETURNING generation_id"
    )
    registered = await asyncio.gather(
        *(
            sink.register_default(generation, chunk_max_tokens=128, chunk_overlap_tokens=0)
            for _ in range(4)
        )
    )
    assert len({g.generation_id for g in registered}) == 1
    default = registered[0]
    assert default.is_default
    assert default.generation_id != other
    assert default.chunking_settings is not None
    assert generation.chunking_strategy.startswith(default.chunking_settings + ":code=")
    rows = await pool.fetch("SELECT generation_id, is_default FROM search_generation")
    assert {(r["generation_id"], r["is_default"]) for r in rows} == {
        (other, False),
        (default.generation_id, True),
    }


async def test_a_backfill_of_a_generation_beside_the_served_one_leaves_the_pointer(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with generations_indexer(pool, monkeypatch) as (indexer, default):
        queue = PgTaskQueue(pool)
        created = await create_task(pool)
        # The serving generation (the default: the tenant has no rows) moves the pointer.
        await run(queue, indexer, created.task_id)
        assert await pointer(pool, created) == (1, DEFAULT_MODEL)
        served_count = (await chunks(pool, created))[(DEFAULT_MODEL, 1)]
        assert await built(pool, created) == {default.generation_id: (1, served_count)}

        other = await add_generation(pool)
        await build_tenant_in(pool, created.tenant_id, default.generation_id, other)
        backfill = await add_task(pool, created, 1, other, priority=1)
        await run(queue, indexer, backfill)

        held = await chunks(pool, created)
        assert held[(OTHER_MODEL, 1)] >= 1
        assert await pointer(pool, created) == (1, DEFAULT_MODEL)  # not moved
        assert await built(pool, created) == {
            default.generation_id: (1, served_count),
            other: (1, held[(OTHER_MODEL, 1)]),
        }
        settings = await pool.fetchval(
            "SELECT chunking_settings FROM search_generation WHERE generation_id = $1", other
        )
        assert settings is not None  # recorded by its first build
        assert "max=96" in settings

        # The next version in that generation supersedes its own older chunks, nothing else:
        # the collector deletes them.
        await publish_version(pool, created, 2)
        await pool.execute(
            "UPDATE index_task SET generation_id = $1 WHERE tenant_id = $2"
            " AND document_id = $3 AND version_number = 2",
            other,
            created.tenant_id,
            created.document_id,
        )
        [v2] = await pool.fetch(
            "SELECT task_id FROM index_task WHERE document_id = $1 AND version_number = 2",
            created.document_id,
        )
        await run(queue, indexer, v2["task_id"])
        held = await chunks(pool, created)
        assert set(held) == {(DEFAULT_MODEL, 1), (OTHER_MODEL, 1), (OTHER_MODEL, 2)}
        assert (await built(pool, created))[other][0] == 2
        assert await pointer(pool, created) == (1, DEFAULT_MODEL)

        assert await collect(pool) == GcRound(documents=1, chunks=held[(OTHER_MODEL, 1)])
        assert set(await chunks(pool, created)) == {(DEFAULT_MODEL, 1), (OTHER_MODEL, 2)}
        assert (await built(pool, created))[other][0] == 2
        assert await pointer(pool, created) == (1, DEFAULT_MODEL)


async def test_the_serving_generation_moves_the_pointer_and_records_its_version(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with generations_indexer(pool, monkeypatch) as (indexer, default):
        queue = PgTaskQueue(pool)
        created = await create_task(pool)
        await run(queue, indexer, created.task_id)
        other = await add_generation(pool)
        await build_tenant_in(pool, created.tenant_id, default.generation_id, other)
        await run(queue, indexer, await add_task(pool, created, 1, other, priority=1))
        await switch(pool, created.tenant_id, other)

        # A publish after the switch: its task (no generation named) builds the new one.
        v2 = await publish_version(pool, created, 2)
        await run(queue, indexer, v2)
        assert await pointer(pool, created) == (2, OTHER_MODEL)
        assert (await built(pool, created))[other][0] == 2
        held = await chunks(pool, created)
        assert {(OTHER_MODEL, 1), (OTHER_MODEL, 2), (DEFAULT_MODEL, 1)} <= set(held)
        # The collector deletes the served generation's superseded version; the old
        # generation's rows stay for a rollback.
        assert (await collect(pool)).chunks == held[(OTHER_MODEL, 1)]
        held = await chunks(pool, created)
        assert (OTHER_MODEL, 1) not in held
        assert (DEFAULT_MODEL, 1) in held
        assert (await built(pool, created))[default.generation_id][0] == 1


async def test_a_task_of_the_serving_generation_that_stopped_serving_completes_beside_it(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with generations_indexer(pool, monkeypatch) as (indexer, default):
        queue = PgTaskQueue(pool)
        created = await create_task(pool)
        other = await add_generation(pool)
        await build_tenant_in(pool, created.tenant_id, default.generation_id, other)

        lease = await claim(queue, created.task_id)
        assert lease.generation_id is None  # the tenant's serving generation, whichever
        outcome = await indexer.index(lease)  # resolved to the default, which serves now
        await switch(pool, created.tenant_id, other)
        with structlog.testing.capture_logs() as logs:
            await queue.complete(lease, in_transaction=outcome.write)
        [said] = [e for e in logs if e["event"] == "task.generation_no_longer_serving"]
        assert (said["generation_id"], said["serving_generation_id"]) == (
            default.generation_id,
            other,
        )

        # Completed into the generation it was resolved to, beside the one that serves: its
        # chunks and its version recorded there, the pointer not moved.
        task = await queue.get(created.task_id)
        assert task is not None
        assert task.status == "SUCCEEDED"
        held = await chunks(pool, created)
        assert set(held) == {(DEFAULT_MODEL, 1)}
        assert await built(pool, created) == {default.generation_id: (1, held[(DEFAULT_MODEL, 1)])}
        assert await pointer(pool, created) is None

        # The generation that serves gets the version through its own task (the publish's
        # dual write, or its backfill), which moves the pointer.
        await run(queue, indexer, await add_task(pool, created, 1, other, priority=1))
        assert await pointer(pool, created) == (1, OTHER_MODEL)
        assert set(await built(pool, created)) == {default.generation_id, other}
        assert (DEFAULT_MODEL, 1) in await chunks(pool, created)


async def test_a_task_of_a_retiring_generation_succeeds_writing_nothing(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with generations_indexer(pool, monkeypatch) as (indexer, default):
        queue = PgTaskQueue(pool)
        created = await create_task(pool)
        await run(queue, indexer, created.task_id)
        other = await add_generation(pool)
        await build_tenant_in(pool, created.tenant_id, default.generation_id, other)
        backfill = await add_task(pool, created, 1, other, priority=1)

        lease = await claim(queue, backfill)
        outcome = await indexer.index(lease)  # still ACTIVE: its chunks are built
        await pool.execute(
            "UPDATE search_generation SET state = 'RETIRING' WHERE generation_id = $1", other
        )
        await queue.complete(lease, in_transaction=outcome.write)
        assert (OTHER_MODEL, 1) not in await chunks(pool, created)
        assert other not in await built(pool, created)

        # Claimed once retiring: nothing is even indexed.
        await pool.execute("DELETE FROM index_task WHERE task_id = $1", backfill)
        again = await add_task(pool, created, 1, other, priority=0)
        lease = await claim(queue, again)
        outcome = await indexer.index(lease)
        assert outcome.write is None
        await queue.complete(lease, in_transaction=outcome.write)
        task = await queue.get(again)
        assert task is not None
        assert task.status == "SUCCEEDED"


async def test_a_tenants_publish_is_claimed_before_its_older_backfill(
    pool: asyncpg.Pool[Any],
) -> None:
    created = await create_task(pool)  # priority 0, due now
    other = await add_generation(pool)
    backfill = await add_task(pool, created, 1, other, priority=1, age_seconds=3600)
    queue = PgTaskQueue(pool)
    [first] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert (first.task_id, first.generation_id) == (created.task_id, None)
    [second] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert (second.task_id, second.generation_id) == (backfill, other)


async def test_streamed_documents_are_built_in_their_generation_too(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streaming path (slices staged, moved in by the fenced completion) keeps the same
    rules: the serving generation's completion moves the pointer, the other's records its
    version only, and one whose generation is retiring leaves no staged slice behind."""
    streaming = {"slice_chunks": 4, "stream_above_chunks": 0}
    async with generations_indexer(pool, monkeypatch, **streaming) as (indexer, default):
        queue = PgTaskQueue(pool)
        created = await create_task(pool, content=make_large_text(120))
        await run(queue, indexer, created.task_id)
        served = (await chunks(pool, created))[(DEFAULT_MODEL, 1)]
        assert served > 4  # more than one slice
        assert await pointer(pool, created) == (1, DEFAULT_MODEL)

        other = await add_generation(pool)
        await build_tenant_in(pool, created.tenant_id, default.generation_id, other)
        await run(queue, indexer, await add_task(pool, created, 1, other, priority=1))
        held = await chunks(pool, created)
        assert await built(pool, created) == {
            default.generation_id: (1, served),
            other: (1, held[(OTHER_MODEL, 1)]),
        }
        assert await pointer(pool, created) == (1, DEFAULT_MODEL)

        retiring = await add_generation(pool, dimension=16)
        await pool.execute(
            "INSERT INTO tenant_search_generation (tenant_id, generation_id) VALUES ($1, $2)",
            created.tenant_id,
            retiring,
        )
        task_id = await add_task(pool, created, 1, retiring, priority=1)
        lease = await claim(queue, task_id)
        outcome = await indexer.index(lease)
        assert await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk_stream WHERE task_id = $1", task_id
        )
        await pool.execute(
            "UPDATE search_generation SET state = 'RETIRING' WHERE generation_id = $1", retiring
        )
        await queue.complete(lease, in_transaction=outcome.write)
        assert not await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk_stream WHERE task_id = $1", task_id
        )
        assert ("hashing-v1-16", 1) not in await chunks(pool, created)
        assert retiring not in await built(pool, created)
