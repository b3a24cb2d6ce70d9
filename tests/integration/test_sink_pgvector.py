"""The pgvector sink inside the fenced ``complete`` transaction, on real PostgreSQL: a
version becomes searchable in one commit (chunks, pointer, SUCCEEDED, outbox event), a
re-run writes the identical chunk set, a re-run at the served version replaces its chunk set
and count, a lost lease writes nothing, the pointer never moves back, embeddings are reused
per tenant and generation only."""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import numpy as np
import numpy.typing as npt
import pytest

from services.index.ann import model_predicate, partition_ann_index_name, vector_expression
from services.index.generation import IndexGeneration
from services.indexer.chunk import Chunk
from services.indexer.gc.collector import GarbageCollector, GcRound
from services.indexer.gc.settings import GcSettings
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.pgvector import QUERIES, PgVectorSink
from services.indexer.task import Lease, TaskStatus
from services.runtime.errors import ConfigError, DatabaseBusy, LeaseLost
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import DOCUMENT_SEARCH_VERSION_SWITCHED, event_id
from services.runtime.pg.db import create_pool
from services.runtime.pg.sql import load_queries
from services.runtime.pg.transaction import Transaction
from services.runtime.settings import RuntimeSettings
from tests.support import versions
from tests.support.clock import ManualClock
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.paused import PausedWrite
from tests.support.stack import REPO_ROOT
from tests.support.tasks import CreatedTask, create_task

pytestmark = pytest.mark.integration

LEASE = 30.0
DIMENSION = 384
GENERATION = IndexGeneration("test-model-384", DIMENSION, "heading-semchunk-v1:max=256")


class WorkerKilled(Exception):
    """Stands in for a crash between the sink's statements and the commit."""


def make_chunks(
    document_id: uuid.UUID, version: int, texts: list[str], *, heading: str = "Refund policy"
) -> list[Chunk]:
    return versions.make_chunks(
        document_id, version, texts, GENERATION.chunking_strategy, heading=heading
    )


def unit_vectors(count: int, seed: int = 0) -> npt.NDArray[np.float32]:
    vectors = np.random.default_rng(seed).standard_normal((count, DIMENSION)).astype(np.float32)
    normalised: npt.NDArray[np.float32] = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return normalised


async def add_version(pool: asyncpg.Pool[Any], created: CreatedTask, version: int) -> uuid.UUID:
    """Version ``version`` of the document, published, with its PENDING index task."""
    return await versions.publish_version(pool, created, version)


async def claim_task(queue: PgTaskQueue, task_id: uuid.UUID, owner: str = "w1") -> Lease:
    [lease] = await queue.claim("standard", owner, lease_seconds=LEASE)
    assert lease.task_id == task_id
    return lease


async def chunk_rows(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> list[asyncpg.Record]:
    return await pool.fetch(
        """
        SELECT version_number, chunk_id, ordinal, heading_path, text, content_digest,
               embedding_model, chunking_strategy, embedding_dimension, embedding
          FROM knowledge_chunk WHERE document_id = $1 ORDER BY version_number, ordinal
        """,
        document_id,
    )


async def pointer(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> asyncpg.Record | None:
    return await pool.fetchrow(
        "SELECT * FROM document_search_version WHERE document_id = $1", document_id
    )


async def switched_events(pool: asyncpg.Pool[Any]) -> list[asyncpg.Record]:
    return await pool.fetch(
        "SELECT * FROM outbox WHERE event_type = $1 ORDER BY position",
        DOCUMENT_SEARCH_VERSION_SWITCHED,
    )


async def collect(pool: asyncpg.Pool[Any]) -> GcRound:
    """A round of the collector of superseded chunks, keeping nothing below what is served."""
    collector = GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=1000))
    return await collector.collect(max_documents=100)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC))


@pytest.fixture
async def sink(pool: asyncpg.Pool[Any]) -> PgVectorSink:
    sink = PgVectorSink(pool)
    await sink.ensure_generation(GENERATION)
    return sink


async def test_one_fenced_commit_makes_the_version_searchable(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    lease = await claim_task(queue, created.task_id)
    chunks = make_chunks(created.document_id, 1, ["30 days", "no questions asked", "by card"])
    vectors = unit_vectors(len(chunks))

    await queue.complete(lease, in_transaction=sink.writer(lease, GENERATION, chunks, vectors))

    rows = await chunk_rows(pool, created.document_id)
    assert [row["chunk_id"] for row in rows] == [chunk.chunk_id for chunk in chunks]
    assert [row["text"] for row in rows] == [chunk.text for chunk in chunks]
    assert [tuple(row["heading_path"]) for row in rows] == [("Refund policy",)] * 3
    assert [row["content_digest"] for row in rows] == [chunk.content_digest for chunk in chunks]
    assert {row["chunking_strategy"] for row in rows} == {GENERATION.chunking_strategy}
    assert {row["embedding_model"] for row in rows} == {GENERATION.embedding_model}
    stored = np.stack([row["embedding"].to_numpy() for row in rows])
    np.testing.assert_array_equal(stored, vectors)

    current = await pointer(pool, created.document_id)
    assert current is not None
    assert current["version_number"] == 1
    assert current["embedding_model"] == GENERATION.embedding_model
    assert current["chunking_strategy"] == GENERATION.chunking_strategy
    assert current["chunk_count"] == 3
    assert current["task_id"] == created.task_id

    task = await queue.get(created.task_id)
    assert task is not None
    assert task.status is TaskStatus.SUCCEEDED

    [event] = await switched_events(pool)
    expected_id = event_id(
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        created.tenant_id,
        created.document_id,
        1,
        GENERATION.embedding_model,
        lease.lease_attempt,
    )
    assert event["event_id"] == expected_id
    assert event["tenant_id"] == created.tenant_id
    assert event["tier"] == created.tier
    assert event["aggregate_key"] == f"{created.tenant_id}/{created.document_id}"
    decoded = default_registry().decode(event["payload"])
    assert decoded.event_type == DOCUMENT_SEARCH_VERSION_SWITCHED
    record = decoded.record
    assert str(record["eventId"]) == str(expected_id)
    assert record["tenantId"] == created.tenant_id
    assert record["tier"] == created.tier
    assert str(record["documentId"]) == str(created.document_id)
    assert record["versionNumber"] == 1
    assert record["previousVersionNumber"] is None
    assert record["embeddingModel"] == GENERATION.embedding_model
    assert record["chunkCount"] == 3
    assert str(record["taskId"]) == str(created.task_id)
    assert record["occurredAt"] == current["switched_at"]


async def test_a_newer_version_moves_the_pointer_forward_and_names_the_previous_one(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    v1 = await claim_task(queue, created.task_id)
    chunks_v1 = make_chunks(created.document_id, 1, ["30 days"])
    await queue.complete(v1, in_transaction=sink.writer(v1, GENERATION, chunks_v1, unit_vectors(1)))

    v2_task = await add_version(pool, created, 2)
    v2 = await claim_task(queue, v2_task)
    chunks_v2 = make_chunks(created.document_id, 2, ["60 days", "store credit"])
    await queue.complete(v2, in_transaction=sink.writer(v2, GENERATION, chunks_v2, unit_vectors(2)))

    current = await pointer(pool, created.document_id)
    assert current is not None
    assert (current["version_number"], current["task_id"], current["chunk_count"]) == (
        2,
        v2_task,
        2,
    )
    first, second = await switched_events(pool)
    assert default_registry().decode(first["payload"]).record["versionNumber"] == 1
    record = default_registry().decode(second["payload"]).record
    assert (record["versionNumber"], record["previousVersionNumber"]) == (2, 1)


async def test_a_rerun_after_a_crash_writes_the_identical_chunk_set(
    pool: asyncpg.Pool[Any], sink: PgVectorSink, clock: ManualClock
) -> None:
    created = await create_task(pool, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    chunks = make_chunks(created.document_id, 1, [f"passage {n}" for n in range(50)])
    vectors = unit_vectors(len(chunks))

    # Attempt 1 dies inside the transaction, after the sink's statements ran: all rolled back.
    first = await claim_task(queue, created.task_id, owner="crashed")
    write = sink.writer(first, GENERATION, chunks, vectors)

    async def crash_after_write(conn: Transaction) -> None:
        await write(conn)
        raise WorkerKilled("worker killed before commit")

    with pytest.raises(WorkerKilled):
        await queue.complete(first, in_transaction=crash_after_write)
    assert await chunk_rows(pool, created.document_id) == []
    assert await pointer(pool, created.document_id) is None
    assert await switched_events(pool) == []

    # Its lease expires; a second generation re-runs the task and commits.
    clock.advance(LEASE + 1)
    second = await claim_task(queue, created.task_id, owner="rescuer")
    assert second.lease_attempt == first.lease_attempt + 1
    await queue.complete(second, in_transaction=sink.writer(second, GENERATION, chunks, vectors))
    committed = await chunk_rows(pool, created.document_id)
    assert [row["chunk_id"] for row in committed] == [chunk.chunk_id for chunk in chunks]

    # The same write again (a worker re-running it after a commit it never heard of):
    # the identical set, no duplicates, no second switch or event.
    async with pool.acquire() as conn, conn.transaction():
        await sink.writer(second, GENERATION, chunks, vectors)(conn)
    assert await chunk_rows(pool, created.document_id) == committed
    assert len(await switched_events(pool)) == 1
    current = await pointer(pool, created.document_id)
    assert current is not None
    assert current["version_number"] == 1


async def test_a_worker_whose_lease_was_taken_over_writes_nothing(
    pool: asyncpg.Pool[Any], sink: PgVectorSink, clock: ManualClock
) -> None:
    created = await create_task(pool, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    old = await claim_task(queue, created.task_id, owner="slow")
    clock.advance(LEASE + 1)
    new = await claim_task(queue, created.task_id, owner="rescuer")
    chunks = make_chunks(created.document_id, 1, ["30 days", "by card"])
    old_write = sink.writer(old, GENERATION, chunks, unit_vectors(2))
    reached: list[bool] = []

    async def watched_write(conn: Transaction) -> None:
        reached.append(True)
        await old_write(conn)

    with pytest.raises(LeaseLost):
        await queue.complete(old, in_transaction=watched_write)
    assert reached == []  # the fence failed first: the sink never ran
    assert await chunk_rows(pool, created.document_id) == []
    assert await pointer(pool, created.document_id) is None
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0
    task = await queue.get(created.task_id)
    assert task is not None
    assert (task.status, task.lease_owner, task.attempts) == (TaskStatus.RUNNING, "rescuer", 2)

    # The rescuer still completes normally.
    await queue.complete(new, in_transaction=sink.writer(new, GENERATION, chunks, unit_vectors(2)))
    assert len(await chunk_rows(pool, created.document_id)) == 2


async def test_no_takeover_slips_in_while_the_sink_writes(
    settings: RuntimeSettings, sink: PgVectorSink, clock: ManualClock
) -> None:
    pool = await create_pool(settings, min_size=3, max_size=3)
    try:
        created = await create_task(pool, next_attempt_at=clock.now())
        queue = PgTaskQueue(pool, clock=clock)
        lease = await claim_task(queue, created.task_id, owner="writer")
        write = PgVectorSink(pool).writer(
            lease, GENERATION, make_chunks(created.document_id, 1, ["30 days"]), unit_vectors(1)
        )
        paused = PausedWrite(write)
        completing = asyncio.create_task(queue.complete(lease, in_transaction=paused))
        await paused.reached.wait()
        # The lease runs out while the transaction is open: a claimer skips the locked row.
        clock.advance(LEASE + 1)
        assert await queue.claim("standard", "rescuer", lease_seconds=LEASE) == []
        paused.release.set()
        await completing
        assert await queue.claim("standard", "rescuer", lease_seconds=LEASE) == []
        task = await queue.get(created.task_id)
        assert task is not None
        assert (task.status, task.lease_owner) == (TaskStatus.SUCCEEDED, "writer")
        assert len(await chunk_rows(pool, created.document_id)) == 1
    finally:
        await pool.close()


async def test_the_search_pointer_never_moves_back(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    v2_task = await add_version(pool, created, 2)
    queue = PgTaskQueue(pool)
    # Both claimed; v2 finishes first, v1 late.
    leases = await queue.claim("standard", "w", lease_seconds=LEASE, limit=2)
    by_version = {lease.version_number: lease for lease in leases}
    v1, v2 = by_version[1], by_version[2]
    assert v2.task_id == v2_task
    chunks_v2 = make_chunks(created.document_id, 2, ["60 days"])
    await queue.complete(v2, in_transaction=sink.writer(v2, GENERATION, chunks_v2, unit_vectors(1)))
    chunks_v1 = make_chunks(created.document_id, 1, ["30 days", "by card"])
    await queue.complete(v1, in_transaction=sink.writer(v1, GENERATION, chunks_v1, unit_vectors(2)))

    task_v1 = await queue.get(v1.task_id)
    assert task_v1 is not None
    assert task_v1.status is TaskStatus.SUCCEEDED
    current = await pointer(pool, created.document_id)
    assert current is not None
    assert (current["version_number"], current["task_id"]) == (2, v2_task)
    [event] = await switched_events(pool)
    assert default_registry().decode(event["payload"]).record["versionNumber"] == 2
    # The late version's chunks were written, and nothing will ever serve them: the
    # collector deletes them (tests/integration/test_superseded_collection.py).
    rows = await chunk_rows(pool, created.document_id)
    assert [(row["version_number"], row["ordinal"]) for row in rows] == [(1, 0), (1, 1), (2, 0)]
    assert await collect(pool) == GcRound(documents=1, chunks=2)
    rows = await chunk_rows(pool, created.document_id)
    assert [(row["version_number"], row["ordinal"]) for row in rows] == [(2, 0)]

    # Nobody else can take it back either: the trigger refuses plain SQL.
    with pytest.raises(asyncpg.CheckViolationError, match="cannot move back"):
        await pool.execute(
            "UPDATE document_search_version SET version_number = 1 WHERE document_id = $1",
            created.document_id,
        )
    current = await pointer(pool, created.document_id)
    assert current is not None
    assert current["version_number"] == 2
    # Rewriting the same version (a generation switch) is not a move back.
    await pool.execute(
        "UPDATE document_search_version SET embedding_model = 'other' WHERE document_id = $1",
        created.document_id,
    )


async def test_known_embeddings_are_this_tenants_and_this_generations_only(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    queue = PgTaskQueue(pool)
    texts = ["30 days", "no questions asked", "by card"]
    stored: dict[str, npt.NDArray[np.float32]] = {}
    digests: list[bytes] = []
    for seed, tenant in enumerate(["acme", "globex"]):
        created = await create_task(pool, tenant_id=tenant)
        lease = await claim_task(queue, created.task_id)
        chunks = make_chunks(created.document_id, 1, texts[:2] if tenant == "acme" else texts)
        vectors = unit_vectors(len(chunks), seed=seed)
        stored[tenant] = vectors
        digests = [chunk.content_digest for chunk in chunks]
        await queue.complete(lease, in_transaction=sink.writer(lease, GENERATION, chunks, vectors))
    unseen = hashlib.sha256(b"never indexed").digest()

    known = await sink.known_embeddings("acme", GENERATION, [*digests, unseen])
    assert set(known) == set(digests[:2])  # acme holds two of globex's three digests
    for row, digest in enumerate(digests[:2]):
        assert known[digest].dtype == np.float32
        np.testing.assert_array_equal(known[digest], stored["acme"][row])

    other_strategy = IndexGeneration(GENERATION.embedding_model, DIMENSION, "another-strategy")
    assert await sink.known_embeddings("acme", other_strategy, digests) == {}
    assert await sink.known_embeddings("initech", GENERATION, digests) == {}
    assert await sink.known_embeddings("acme", GENERATION, []) == {}


@pytest.fixture
async def wide_pool(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await create_pool(settings, min_size=6, max_size=6)
    try:
        yield pool
    finally:
        await pool.close()


async def ann_indexes(pool: asyncpg.Pool[Any]) -> list[asyncpg.Record]:
    return await pool.fetch(
        """
        SELECT c.relname, i.indisvalid, pg_get_indexdef(c.oid) AS definition
          FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = 'knowledge_chunk'::regclass AND c.relname LIKE 'knowledge_chunk_ann_%'
        """
    )


async def test_concurrent_ensure_generation_builds_one_valid_hnsw_index_that_queries_use(
    wide_pool: asyncpg.Pool[Any],
) -> None:
    generation = IndexGeneration("concurrent-model", DIMENSION, "s1")
    # KB_INDEXER_PARTITION_GRAPHS on: the model's partitioned index is built.
    sinks = [PgVectorSink(wide_pool, partition_graphs=True) for _ in range(5)]
    await asyncio.gather(*(sink.ensure_generation(generation) for sink in sinks))
    await sinks[0].ensure_generation(generation)
    # A second strategy of the same model shares the model's index.
    await sinks[0].ensure_generation(IndexGeneration("concurrent-model", DIMENSION, "s2"))

    [index] = await ann_indexes(wide_pool)
    assert index["relname"] == generation.ann_index_name
    assert index["indisvalid"]
    assert "USING hnsw" in index["definition"]
    assert "vector_cosine_ops" in index["definition"]
    registered = await sinks[0].generations()
    assert {(g.generation.chunking_strategy, g.ann_index_name) for g in registered} == {
        ("s1", generation.ann_index_name),
        ("s2", generation.ann_index_name),
    }

    created = await create_task(wide_pool)
    await wide_pool.execute(
        """
        INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                                     chunking_strategy, chunk_id, ordinal, text, content_digest,
                                     embedding_dimension, embedding)
        SELECT $1, $2, 1, $3, 's1', 'c' || n, n, 'text ' || n, sha256(n::text::bytea), $4,
               -- correlated (n >= 0), so each row gets its own random vector
               (SELECT array_agg(random())::vector FROM generate_series(1, $4) WHERE n >= 0)
          FROM generate_series(0, 1999) AS n
        """,
        created.tenant_id,
        created.document_id,
        generation.embedding_model,
        DIMENSION,
    )
    await wide_pool.execute("ANALYZE knowledge_chunk")
    query_vector = unit_vectors(1, seed=7)[0]

    async with wide_pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        plan = await conn.fetchval(
            f"""
            EXPLAIN (FORMAT JSON)
            SELECT chunk_id FROM knowledge_chunk
             WHERE {model_predicate(generation.embedding_model)}
               AND tenant_id = '{created.tenant_id}'
             ORDER BY {vector_expression(DIMENSION)} <=> $1::vector({DIMENSION})
             LIMIT 10
            """,
            query_vector,
        )
        partition = await conn.fetchval(
            "SELECT tableoid::regclass::text FROM knowledge_chunk WHERE tenant_id = $1 LIMIT 1",
            created.tenant_id,
        )
    # The tenant's partition alone, walked through its part of the model's index.
    used = re.findall(r'"Index Name": "([^"]+)"', plan)
    assert used == [partition_ann_index_name(generation.embedding_model, partition)]

    # The reuse lookup probes knowledge_chunk_reuse, whatever the table's size.
    digests = [hashlib.sha256(str(n).encode()).digest() for n in (5, 50, 500)]
    async with wide_pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        reuse_plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + QUERIES["known_embeddings"],
            created.tenant_id,
            generation.embedding_model,
            "s1",
            DIMENSION,
            digests,
        )
        reuse_parts = {
            r["relid"]
            for r in await conn.fetch(
                "SELECT relid::regclass::text AS relid"
                " FROM pg_partition_tree('knowledge_chunk_reuse') WHERE isleaf"
            )
        }
    used = re.findall(r'"Index Name": "([^"]+)"', reuse_plan)
    assert used
    assert set(used) <= reuse_parts
    known = await sinks[0].known_embeddings(created.tenant_id, generation, digests)
    assert set(known) == set(digests)


async def test_an_invalid_index_left_by_a_failed_build_is_dropped_and_rebuilt(
    pool: asyncpg.Pool[Any],
) -> None:
    generation = IndexGeneration("rebuilt-model", DIMENSION, "s1")
    created = await create_task(pool)
    # A row of the model with the wrong dimension makes the build fail half way.
    await pool.execute(
        """
        INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                                     chunking_strategy, chunk_id, ordinal, text, content_digest,
                                     embedding_dimension, embedding)
        VALUES ($1, $2, 1, $3, 's1', 'bad', 0, 'bad', '\\x00', 3, '[1,2,3]')
        """,
        created.tenant_id,
        created.document_id,
        generation.embedding_model,
    )
    sink = PgVectorSink(pool, index_build_memory="77MB", partition_graphs=True)
    with pytest.raises(Exception, match="expected 384 dimensions"):
        await sink.ensure_generation(generation)
    [leftover] = await ann_indexes(pool)
    assert not leftover["indisvalid"]

    await pool.execute("DELETE FROM knowledge_chunk WHERE chunk_id = 'bad'")
    await sink.ensure_generation(generation)
    [rebuilt] = await ann_indexes(pool)
    assert rebuilt["relname"] == generation.ann_index_name
    assert rebuilt["indisvalid"]
    # The pool's statement_timeout is back on the connection the build used.
    timeouts = {await pool.fetchval("SHOW statement_timeout") for _ in range(3)}
    assert "0" not in timeouts
    # ... and so is its maintenance_work_mem: the build's own budget stays with the build.
    budgets = {await pool.fetchval("SHOW maintenance_work_mem") for _ in range(3)}
    assert "77MB" not in budgets


async def test_the_hnsw_build_runs_with_its_own_memory_budget(pool: asyncpg.Pool[Any]) -> None:
    # An unparsable budget fails the build itself: the setting reaches the build's session.
    sink = PgVectorSink(pool, index_build_memory="a lot", partition_graphs=True)
    with pytest.raises(Exception, match="maintenance_work_mem"):
        await sink.ensure_generation(IndexGeneration("budget-model", DIMENSION, "s1"))
    assert await ann_indexes(pool) == []


async def test_with_partition_graphs_off_a_generation_is_registered_without_one(
    pool: asyncpg.Pool[Any],
) -> None:
    generation = IndexGeneration("graphless-model", DIMENSION, "s1")
    sink = PgVectorSink(pool)  # KB_INDEXER_PARTITION_GRAPHS' default: off
    await sink.ensure_generation(generation)
    assert await ann_indexes(pool) == []
    assert [g.generation for g in await sink.generations()] == [generation]

    # One an indexer built with them on is left as it is: no DROP, which would take
    # knowledge_chunk's ACCESS EXCLUSIVE lock.
    await PgVectorSink(pool, partition_graphs=True).ensure_generation(generation)
    await sink.ensure_generation(generation)
    [kept] = await ann_indexes(pool)
    assert kept["relname"] == generation.ann_index_name
    assert kept["indisvalid"]


async def test_a_model_keeps_one_dimension(pool: asyncpg.Pool[Any], sink: PgVectorSink) -> None:
    with pytest.raises(ConfigError, match="one dimension"):
        await sink.ensure_generation(IndexGeneration(GENERATION.embedding_model, 768, "other"))


async def test_the_writer_refuses_embeddings_that_do_not_fit(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    [lease] = await PgTaskQueue(pool).claim("standard", "w", lease_seconds=LEASE)
    chunks = make_chunks(created.document_id, 1, ["a", "b"])
    with pytest.raises(ValueError, match="shape"):
        sink.writer(lease, GENERATION, chunks, unit_vectors(3))
    broken = unit_vectors(2)
    broken[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        sink.writer(lease, GENERATION, chunks, broken)


async def test_concurrent_switches_of_one_document_serialise_on_the_pointer(
    settings: RuntimeSettings, sink: PgVectorSink
) -> None:
    """v1's transaction has created the pointer but not committed when v2's reaches it: v2
    waits for the row, then moves it on from v1 and names v1 as the previous version."""
    pool = await create_pool(settings, min_size=3, max_size=3)
    try:
        created = await create_task(pool)
        v2_task = await add_version(pool, created, 2)
        queue = PgTaskQueue(pool)
        leases = await queue.claim("standard", "w", lease_seconds=LEASE, limit=2)
        v1, v2 = sorted(leases, key=lambda lease: lease.version_number)
        assert v2.task_id == v2_task
        write_v1 = sink.writer(
            v1, GENERATION, make_chunks(created.document_id, 1, ["a"]), unit_vectors(1)
        )
        v1_paused = PausedWrite(write_v1)
        first = asyncio.create_task(queue.complete(v1, in_transaction=v1_paused))
        await v1_paused.reached.wait()
        # Another worker's queue: one queue commits its completions one group at a time.
        second = asyncio.create_task(
            PgTaskQueue(pool).complete(
                v2,
                in_transaction=sink.writer(
                    v2, GENERATION, make_chunks(created.document_id, 2, ["b"]), unit_vectors(1)
                ),
            )
        )
        await wait_until_blocked_on_a_lock(pool)
        v1_paused.release.set()
        await asyncio.gather(first, second)

        current = await pointer(pool, created.document_id)
        assert current is not None
        assert current["version_number"] == 2
        records = [
            default_registry().decode(event["payload"]).record
            for event in await switched_events(pool)
        ]
        assert [(r["versionNumber"], r["previousVersionNumber"]) for r in records] == [
            (1, None),
            (2, 1),
        ]
    finally:
        await pool.close()


async def test_a_write_over_its_time_budget_is_rolled_back_whole(pool: asyncpg.Pool[Any]) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    lease = await claim_task(queue, created.task_id)
    sink = PgVectorSink(pool, write_timeout_seconds=0.001, write_timeout_per_chunk_seconds=0)
    chunks = make_chunks(created.document_id, 1, [f"passage {n}" for n in range(3000)])
    write = sink.writer(lease, GENERATION, chunks, unit_vectors(len(chunks)))
    with pytest.raises(DatabaseBusy):
        await queue.complete(lease, in_transaction=write)
    assert await chunk_rows(pool, created.document_id) == []
    assert await pointer(pool, created.document_id) is None
    task = await queue.get(created.task_id)
    assert task is not None
    assert task.status is TaskStatus.RUNNING
    # The budget was the transaction's own: the connection is back at the pool's timeout.
    assert {await pool.fetchval("SHOW statement_timeout") for _ in range(3)} == {"30s"}
    assert PgVectorSink(pool).write_timeout_ms(2000) == 130_000


# --- a re-run at the served version replaces its chunk set ----------------------------------

# The same model and chunk settings chunked by newer code: what a re-run after a chunker
# upgrade writes.
UPGRADED = IndexGeneration(
    GENERATION.embedding_model, DIMENSION, f"{GENERATION.chunking_strategy}:code=0123456789ab"
)
SERVED_CHUNKS = load_queries(
    REPO_ROOT / "services" / "runtime" / "indexing" / "search_version.sql"
)["current_version_chunks"]


async def served_texts(
    db: asyncpg.Pool[Any] | asyncpg.Connection[Any], document_id: uuid.UUID
) -> list[str]:
    """What search serves of the document: the chunks its pointer names."""
    rows = await db.fetch(
        f"SELECT text FROM ({SERVED_CHUNKS}) c WHERE c.document_id = $1 ORDER BY c.ordinal",
        document_id,
    )
    return [row["text"] for row in rows]


async def version_strategies(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT chunking_strategy, count(*) AS n FROM knowledge_chunk WHERE document_id = $1"
        " GROUP BY chunking_strategy",
        document_id,
    )
    return {row["chunking_strategy"]: row["n"] for row in rows}


async def rerun(queue: PgTaskQueue, task_id: uuid.UUID, owner: str = "w2") -> Lease:
    """The task put back to PENDING as `kb index check --repair` does, and claimed again."""
    requeued = await queue.rerun_succeeded(
        task_id, by="test", budget=3, reason=("INDEX_DRIFT", "re-run by a test")
    )
    assert requeued is not None
    return await claim_task(queue, task_id, owner)


async def test_a_rerun_after_a_chunker_change_serves_one_chunking_with_its_count(
    settings: RuntimeSettings, sink: PgVectorSink
) -> None:
    pool = await create_pool(settings, min_size=3, max_size=3)
    try:
        await sink.ensure_generation(UPGRADED)
        created = await create_task(pool)
        document_id = created.document_id
        queue = PgTaskQueue(pool)
        first = await claim_task(queue, created.task_id)
        old_texts = ["30 days", "no questions asked", "by card"]
        old = make_chunks(document_id, 1, old_texts)
        await queue.complete(
            first, in_transaction=sink.writer(first, GENERATION, old, unit_vectors(3))
        )
        before = await pointer(pool, document_id)
        assert before is not None

        # The upgraded chunker cuts the same version into other, fewer chunks.
        again = await rerun(queue, created.task_id)
        new_texts = ["30 days, no questions asked", "by card or by bank transfer"]
        new = versions.make_chunks(document_id, 1, new_texts, UPGRADED.chunking_strategy)
        write = sink.writer(again, UPGRADED, new, unit_vectors(2, seed=1))
        paused = PausedWrite(write)
        completing = asyncio.create_task(queue.complete(again, in_transaction=paused))
        await paused.reached.wait()
        # Until it commits, readers see the old chunking whole: nothing deleted, nothing new.
        assert await served_texts(pool, document_id) == old_texts
        paused.release.set()
        await completing

        assert await served_texts(pool, document_id) == new_texts
        # One chunking left at the served version; the pointer names it and counts it.
        assert await version_strategies(pool, document_id) == {UPGRADED.chunking_strategy: 2}
        current = await pointer(pool, document_id)
        assert current is not None
        assert (current["version_number"], current["chunking_strategy"]) == (
            1,
            UPGRADED.chunking_strategy,
        )
        assert (current["chunk_count"], current["task_id"]) == (2, created.task_id)
        assert current["switched_at"] > before["switched_at"]
        # The served set changed: that is a switch of its own, at the same version.
        _, replaced = await switched_events(pool)
        record = default_registry().decode(replaced["payload"]).record
        assert (record["versionNumber"], record["previousVersionNumber"]) == (1, 1)
        assert record["chunkCount"] == 2
    finally:
        await pool.close()


async def test_a_rerun_that_chunks_the_same_strategy_otherwise_keeps_only_its_own_set(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    """Chunks of one strategy id but other texts (a parser upgrade before parser versions
    were part of the id): the re-run's set replaces the old one, it is not added to it."""
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    first = await claim_task(queue, created.task_id)
    old = make_chunks(created.document_id, 1, ["30 days", "no questions asked", "by card"])
    await queue.complete(first, in_transaction=sink.writer(first, GENERATION, old, unit_vectors(3)))

    again = await rerun(queue, created.task_id)
    # The first chunk unchanged (same id, written again), the others cut otherwise.
    new = make_chunks(created.document_id, 1, ["30 days", "no questions asked, by card"])
    assert new[0].chunk_id == old[0].chunk_id
    await queue.complete(again, in_transaction=sink.writer(again, GENERATION, new, unit_vectors(2)))

    rows = await chunk_rows(pool, created.document_id)
    assert [row["chunk_id"] for row in rows] == [chunk.chunk_id for chunk in new]
    assert [row["text"] for row in rows] == ["30 days", "no questions asked, by card"]
    current = await pointer(pool, created.document_id)
    assert current is not None
    assert (current["version_number"], current["chunk_count"]) == (1, 2)


async def test_an_identical_rerun_fills_the_gaps_and_leaves_the_pointer_alone(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    first = await claim_task(queue, created.task_id)
    chunks = make_chunks(created.document_id, 1, [f"passage {n}" for n in range(6)])
    vectors = unit_vectors(6)
    await queue.complete(first, in_transaction=sink.writer(first, GENERATION, chunks, vectors))
    before = await pointer(pool, created.document_id)
    await pool.execute(
        "DELETE FROM knowledge_chunk WHERE document_id = $1 AND ordinal % 2 = 0",
        created.document_id,
    )

    again = await rerun(queue, created.task_id)
    await queue.complete(again, in_transaction=sink.writer(again, GENERATION, chunks, vectors))

    rows = await chunk_rows(pool, created.document_id)
    assert [row["chunk_id"] for row in rows] == [chunk.chunk_id for chunk in chunks]
    assert await pointer(pool, created.document_id) == before
    assert len(await switched_events(pool)) == 1


async def test_a_rerun_that_lost_its_lease_replaces_nothing(
    pool: asyncpg.Pool[Any], sink: PgVectorSink, clock: ManualClock
) -> None:
    created = await create_task(pool, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    first = await claim_task(queue, created.task_id)
    old = make_chunks(created.document_id, 1, ["30 days", "by card"])
    await queue.complete(first, in_transaction=sink.writer(first, GENERATION, old, unit_vectors(2)))
    rows_before = await chunk_rows(pool, created.document_id)
    pointer_before = await pointer(pool, created.document_id)

    slow = await rerun(queue, created.task_id, owner="slow")
    clock.advance(LEASE + 1)
    rescuer = await claim_task(queue, created.task_id, owner="rescuer")
    new = versions.make_chunks(
        created.document_id, 1, ["30 days by card"], UPGRADED.chunking_strategy
    )
    with pytest.raises(LeaseLost):
        await queue.complete(slow, in_transaction=sink.writer(slow, UPGRADED, new, unit_vectors(1)))
    assert await chunk_rows(pool, created.document_id) == rows_before
    assert await pointer(pool, created.document_id) == pointer_before
    assert len(await switched_events(pool)) == 1

    await queue.complete(
        rescuer, in_transaction=sink.writer(rescuer, UPGRADED, new, unit_vectors(1))
    )
    assert await version_strategies(pool, created.document_id) == {UPGRADED.chunking_strategy: 1}


async def test_a_streamed_rerun_at_the_served_version_replaces_its_chunk_set(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    first = await claim_task(queue, created.task_id)
    old = make_chunks(created.document_id, 1, [f"old passage {n}" for n in range(5)])
    await queue.complete(first, in_transaction=sink.writer(first, GENERATION, old, unit_vectors(5)))

    again = await rerun(queue, created.task_id)
    new = versions.make_chunks(
        created.document_id, 1, [f"new passage {n}" for n in range(3)], UPGRADED.chunking_strategy
    )
    vectors = unit_vectors(3, seed=2)
    await sink.stage(again, UPGRADED, new[:2], vectors[:2], first=True)
    await sink.stage(again, UPGRADED, new[2:], vectors[2:], first=False)
    await queue.complete(again, in_transaction=sink.stream_writer(again, UPGRADED, 3))

    assert await served_texts(pool, created.document_id) == [c.text for c in new]
    assert await version_strategies(pool, created.document_id) == {UPGRADED.chunking_strategy: 3}
    current = await pointer(pool, created.document_id)
    assert current is not None
    assert (current["chunking_strategy"], current["chunk_count"]) == (UPGRADED.chunking_strategy, 3)


@pytest.mark.parametrize(
    "beside",
    [
        IndexGeneration("beside-model-384", DIMENSION, GENERATION.chunking_strategy),
        IndexGeneration(GENERATION.embedding_model, DIMENSION, "heading-semchunk-v1:max=64"),
    ],
    ids=["another model", "other chunk settings"],
)
async def test_another_generations_task_at_the_served_version_replaces_nothing(
    pool: asyncpg.Pool[Any], sink: PgVectorSink, beside: IndexGeneration
) -> None:
    """A generation built beside the served one (another model, or other chunk settings)
    writes its own chunks of the version and leaves the served set and the pointer as they
    are."""
    await sink.ensure_generation(beside)
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    first = await claim_task(queue, created.task_id)
    served = make_chunks(created.document_id, 1, ["30 days", "by card"])
    await queue.complete(
        first, in_transaction=sink.writer(first, GENERATION, served, unit_vectors(2))
    )
    before = await pointer(pool, created.document_id)

    again = await rerun(queue, created.task_id)
    built = versions.make_chunks(created.document_id, 1, ["30 days"], beside.chunking_strategy)
    await queue.complete(again, in_transaction=sink.writer(again, beside, built, unit_vectors(1)))

    assert await pointer(pool, created.document_id) == before
    assert await served_texts(pool, created.document_id) == ["30 days", "by card"]
    generations = await pool.fetch(
        "SELECT embedding_model, chunking_strategy, count(*) AS n FROM knowledge_chunk"
        " WHERE document_id = $1 GROUP BY 1, 2",
        created.document_id,
    )
    assert {(r["embedding_model"], r["chunking_strategy"], r["n"]) for r in generations} == {
        (beside.embedding_model, beside.chunking_strategy, 1),
        (GENERATION.embedding_model, GENERATION.chunking_strategy, 2),
    }


async def test_a_newer_version_leaves_the_older_codes_chunks_of_its_generation_to_collect(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    """After a chunker upgrade the strategy id changes, the generation does not: once the
    next version is served, the collector deletes the chunks the older code wrote."""
    await sink.ensure_generation(UPGRADED)
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    v1 = await claim_task(queue, created.task_id)
    old = make_chunks(created.document_id, 1, ["30 days", "by card"])
    await queue.complete(v1, in_transaction=sink.writer(v1, GENERATION, old, unit_vectors(2)))

    v2 = await claim_task(queue, await add_version(pool, created, 2))
    new = versions.make_chunks(created.document_id, 2, ["60 days"], UPGRADED.chunking_strategy)
    await queue.complete(v2, in_transaction=sink.writer(v2, UPGRADED, new, unit_vectors(1)))
    rows = await chunk_rows(pool, created.document_id)
    assert [(r["version_number"], r["chunking_strategy"]) for r in rows] == [
        (1, GENERATION.chunking_strategy),
        (1, GENERATION.chunking_strategy),
        (2, UPGRADED.chunking_strategy),
    ]

    assert await collect(pool) == GcRound(documents=1, chunks=2)

    rows = await chunk_rows(pool, created.document_id)
    assert [(r["version_number"], r["chunking_strategy"]) for r in rows] == [
        (2, UPGRADED.chunking_strategy)
    ]
