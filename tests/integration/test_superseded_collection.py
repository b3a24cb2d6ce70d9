"""Superseded versions leave the index through the collector (services/indexer/gc), on real
PostgreSQL: a completion deletes nothing and only marks its document; the collector, outside
any completion, leaves per chunk family (model and chunk settings) only the served version
and KB_INDEX_KEEP_PREVIOUS versions below it -- never another generation's chunks, never a
newer version's; racing versions of one document leave only the served one; the streamed
completion's document is collected the same way; a search whose snapshot predates the switch
and the collection still reads the whole old version; the delete walks the primary key of the
tenant's partition; and `kb index check` finds nothing to say about the result."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Generator, Iterator
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any, cast

import asyncpg
import pytest

from services.embedding.batching import Batching
from services.embedding.hashing import HashingEmbedder
from services.index.generation import CODE_MARK, IndexGeneration
from services.indexer.chunk import Chunk
from services.indexer.gc.collector import QUERIES, GarbageCollector, GcRound
from services.indexer.gc.settings import GcSettings
from services.indexer.maintenance.index_check_pg import PgIndexCheck
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.source_pg import PgVersionSource
from services.indexer.pipeline.version_indexer import PipelineIndexer, chunking_strategy
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease
from services.runtime.indexing.media_types import MARKDOWN
from services.runtime.pg.db import create_pool
from services.runtime.pg.transaction import Transaction
from services.runtime.settings import RuntimeSettings
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, Searcher, SearchMode, SearchRequest
from services.search.statements import SearchSettings, VectorPath
from tests.support.clock import ManualClock
from tests.support.locks import RowTaker, wait_until_blocked_on_a_lock
from tests.support.search import EXACT_MAX_CHUNKS
from tests.support.stack import REPO_ROOT
from tests.support.tasks import create_task
from tests.support.versions import make_chunks, publish_version

pytestmark = pytest.mark.integration

LEASE = 30.0
EMBEDDER = HashingEmbedder(dimension=64)
GENERATION = IndexGeneration(EMBEDDER.model, EMBEDDER.dimension, "heading-semchunk-v1:max=64")
# Generations built beside the served one: another strategy of the model, another model.
OTHER_STRATEGY = IndexGeneration(EMBEDDER.model, EMBEDDER.dimension, "another-strategy")
OTHER_MODEL = IndexGeneration("other-model-64", EMBEDDER.dimension, GENERATION.chunking_strategy)


def version_texts(version: int, count: int = 12) -> list[str]:
    return [f"refund clause {n} of version {version}" for n in range(count)]


async def claim(queue: PgTaskQueue, task_id: uuid.UUID, owner: str = "w") -> Lease:
    [lease] = await queue.claim("standard", owner, lease_seconds=LEASE)
    assert lease.task_id == task_id
    return lease


async def complete(
    queue: PgTaskQueue, sink: PgVectorSink, lease: Lease, texts: list[str]
) -> list[Chunk]:
    chunks = make_chunks(
        lease.document_id,
        lease.version_number,
        texts,
        GENERATION.chunking_strategy,
        heading="Refunds",
    )
    vectors = EMBEDDER.embed_sync([chunk.text for chunk in chunks])
    await queue.complete(lease, in_transaction=sink.writer(lease, GENERATION, chunks, vectors))
    return chunks


async def write_beside(
    pool: asyncpg.Pool[Any], sink: PgVectorSink, lease: Lease, generation: IndexGeneration
) -> None:
    """The version's chunks under another generation, as a generation build writes them
    (the sink's write in a transaction of its own; the lease is only its data)."""
    chunks = make_chunks(
        lease.document_id,
        lease.version_number,
        ["beside"],
        generation.chunking_strategy,
        heading="Refunds",
    )
    async with pool.acquire() as conn, conn.transaction():
        write = sink.writer(lease, generation, chunks, EMBEDDER.embed_sync(["beside"]))
        await write(conn)


async def chunk_versions(
    pool: asyncpg.Pool[Any], document_id: uuid.UUID
) -> dict[tuple[str, str], list[int]]:
    """The document's chunk count per (model, strategy), as sorted version numbers."""
    rows = await pool.fetch(
        "SELECT embedding_model, chunking_strategy, version_number FROM knowledge_chunk"
        " WHERE document_id = $1 ORDER BY 1, 2, 3",
        document_id,
    )
    found: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        key = (row["embedding_model"], row["chunking_strategy"])
        found.setdefault(key, []).append(row["version_number"])
    return found


def generation_key(generation: IndexGeneration) -> tuple[str, str]:
    return (generation.embedding_model, generation.chunking_strategy)


async def collect(pool: asyncpg.Pool[Any], *, keep_previous: int = 0) -> GcRound:
    """A round of the collector, as `kb index gc` runs it: every marked document."""
    collector = GarbageCollector(pool, GcSettings(keep_previous=keep_previous, gc_batch_rows=1000))
    return await collector.collect(max_documents=100)


async def marked(pool: asyncpg.Pool[Any]) -> set[uuid.UUID]:
    """The documents marked for the collector."""
    return {row["document_id"] for row in await pool.fetch("SELECT document_id FROM index_gc_due")}


@pytest.fixture
async def sink(pool: asyncpg.Pool[Any]) -> PgVectorSink:
    sink = PgVectorSink(pool)
    for generation in (GENERATION, OTHER_STRATEGY, OTHER_MODEL):
        await sink.ensure_generation(generation)
    return sink


async def test_the_collector_leaves_only_the_served_version_of_its_generation(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    v1 = await claim(queue, created.task_id)
    await complete(queue, sink, v1, [*version_texts(1), "unchanged clause"])
    # Two generations being built beside the served one hold v1 too.
    await write_beside(pool, sink, v1, OTHER_STRATEGY)
    await write_beside(pool, sink, v1, OTHER_MODEL)
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [1] * 13,
        generation_key(OTHER_STRATEGY): [1],
        generation_key(OTHER_MODEL): [1],
    }

    v2 = await claim(queue, await publish_version(pool, created, 2))
    v2_chunks = await complete(queue, sink, v2, [*version_texts(2, 5), "unchanged clause"])
    # The switch deleted nothing: it marked the document for the collector.
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [1] * 13 + [2] * 6,
        generation_key(OTHER_STRATEGY): [1],
        generation_key(OTHER_MODEL): [1],
    }
    assert await marked(pool) == {created.document_id}

    assert await collect(pool, keep_previous=0) == GcRound(documents=1, chunks=13)

    assert await marked(pool) == set()
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [2] * 6,
        generation_key(OTHER_STRATEGY): [1],
        generation_key(OTHER_MODEL): [1],
    }
    current = await pool.fetchrow(
        "SELECT version_number, chunk_count FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    assert current is not None
    assert (current["version_number"], current["chunk_count"]) == (2, 6)
    # Reuse by content digest reads the served version's rows.
    unchanged = v2_chunks[-1].content_digest
    known = await sink.known_embeddings(created.tenant_id, GENERATION, [unchanged])
    assert set(known) == {unchanged}
    # Nothing to say for `kb index check`.
    assert await PgIndexCheck(pool).drift(created.tenant_id) == (1, [])


async def test_keep_previous_one_keeps_the_version_below_the_served_one(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    v1 = await claim(queue, created.task_id)
    await complete(queue, sink, v1, version_texts(1, 4))
    await write_beside(pool, sink, v1, OTHER_MODEL)
    v2 = await claim(queue, await publish_version(pool, created, 2))
    await complete(queue, sink, v2, version_texts(2, 3))

    # v1 is the one version kept below the served v2: nothing goes, the mark does.
    assert await collect(pool, keep_previous=1) == GcRound(documents=1, chunks=0)
    assert await marked(pool) == set()
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [1] * 4 + [2] * 3,
        generation_key(OTHER_MODEL): [1],
    }

    v3 = await claim(queue, await publish_version(pool, created, 3))
    await complete(queue, sink, v3, version_texts(3, 2))
    assert await collect(pool, keep_previous=1) == GcRound(documents=1, chunks=4)

    # v2 stays below the served v3, v1 goes; the generation nothing serves is left alone.
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [2] * 3 + [3] * 2,
        generation_key(OTHER_MODEL): [1],
    }
    served = await pool.fetchval(
        "SELECT version_number FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    assert served == 3
    assert await PgIndexCheck(pool).drift(created.tenant_id) == (1, [])


async def test_a_version_finishing_after_a_newer_one_is_collected_and_nothing_newer(
    pool: asyncpg.Pool[Any], sink: PgVectorSink
) -> None:
    created = await create_task(pool)
    v2_task = await publish_version(pool, created, 2)
    queue = PgTaskQueue(pool)
    claimed = await queue.claim("standard", "w", lease_seconds=LEASE, limit=2)
    leases = {lease.version_number: lease for lease in claimed}
    assert leases[2].task_id == v2_task
    # v2 is served, then v1 finishes late: its pointer does not move, and its own chunks,
    # which nothing will ever serve, are collected; v2's stay whole.
    await complete(queue, sink, leases[2], version_texts(2, 3))
    await write_beside(pool, sink, leases[1], OTHER_MODEL)
    await complete(queue, sink, leases[1], version_texts(1, 4))
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [1] * 4 + [2] * 3,
        generation_key(OTHER_MODEL): [1],
    }
    assert await marked(pool) == {created.document_id}

    assert await collect(pool, keep_previous=0) == GcRound(documents=1, chunks=4)

    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [2, 2, 2],
        generation_key(OTHER_MODEL): [1],
    }
    assert await PgIndexCheck(pool).drift(created.tenant_id) == (1, [])


@pytest.mark.parametrize("first", [1, 2], ids=["v1-commits-first", "v2-commits-first"])
async def test_racing_versions_of_one_document_leave_only_the_served_one(
    settings: RuntimeSettings, sink: PgVectorSink, first: int
) -> None:
    """One version's transaction holds the pointer row when the other's reaches it; whichever
    commits first, both versions' chunks are there after them, the pointer serves v2, and the
    collector leaves only v2."""
    pool = await create_pool(settings, min_size=3, max_size=3)
    try:
        created = await create_task(pool)
        await publish_version(pool, created, 2)
        queue = PgTaskQueue(pool)
        claimed = await queue.claim("standard", "w", lease_seconds=LEASE, limit=2)
        leases = {lease.version_number: lease for lease in claimed}
        holder, waiter = leases[first], leases[3 - first]
        texts = {1: version_texts(1, 4), 2: version_texts(2, 3)}
        holding, may_commit = asyncio.Event(), asyncio.Event()
        hold_write = sink.writer(
            holder,
            GENERATION,
            make_chunks(
                created.document_id,
                first,
                texts[first],
                GENERATION.chunking_strategy,
                heading="Refunds",
            ),
            EMBEDDER.embed_sync(texts[first]),
        )

        async def paused_before_commit(conn: Transaction) -> None:
            await hold_write(conn)
            holding.set()
            await may_commit.wait()

        held = asyncio.create_task(queue.complete(holder, in_transaction=paused_before_commit))
        racing: list[asyncio.Task[Any]] = [held]
        try:
            async with asyncio.timeout(30):
                await holding.wait()
            # Another worker's queue: one queue commits its completions one group at a time.
            other = PgTaskQueue(pool)
            racing.append(asyncio.create_task(complete(other, sink, waiter, texts[3 - first])))
            await wait_until_blocked_on_a_lock(pool)
        finally:
            # Whatever failed above, no transaction is left waiting (the pool could not close).
            may_commit.set()
            await asyncio.gather(*racing)

        served = await pool.fetchval(
            "SELECT version_number FROM document_search_version WHERE document_id = $1",
            created.document_id,
        )
        assert served == 2
        assert await chunk_versions(pool, created.document_id) == {
            generation_key(GENERATION): [1] * 4 + [2] * 3
        }
        assert await marked(pool) == {created.document_id}

        assert await collect(pool, keep_previous=0) == GcRound(documents=1, chunks=4)

        assert await chunk_versions(pool, created.document_id) == {
            generation_key(GENERATION): [2, 2, 2]
        }
        assert await marked(pool) == set()
    finally:
        await pool.close()


async def test_a_collector_round_during_a_completion_leaves_its_mark_for_the_next_round(
    settings: RuntimeSettings, sink: PgVectorSink
) -> None:
    """A document already marked (v1's completion) is collected while v2's completion has
    marked it again but not committed: that round cannot see v2, and the document must stay
    marked for a round that can -- else v1 stays in the index until the next publish."""
    pool = await create_pool(settings, min_size=3, max_size=3)
    try:
        created = await create_task(pool)
        queue = PgTaskQueue(pool)
        await complete(queue, sink, await claim(queue, created.task_id), version_texts(1, 4))
        assert await marked(pool) == {created.document_id}
        v2 = await claim(queue, await publish_version(pool, created, 2))
        texts = version_texts(2, 3)
        write = sink.writer(
            v2,
            GENERATION,
            make_chunks(
                created.document_id, 2, texts, GENERATION.chunking_strategy, heading="Refunds"
            ),
            EMBEDDER.embed_sync(texts),
        )
        holding, may_commit = asyncio.Event(), asyncio.Event()

        async def paused_before_commit(conn: Transaction) -> None:
            await write(conn)
            holding.set()
            await may_commit.wait()

        completing = asyncio.create_task(queue.complete(v2, in_transaction=paused_before_commit))
        try:
            async with asyncio.timeout(30):
                await holding.wait()
            # v2's completion has marked and switched, uncommitted: its mark is locked, so a
            # round now skips the document rather than forget it.
            during = await collect(pool, keep_previous=0)
        finally:
            may_commit.set()
            await completing
        assert during == GcRound(documents=0, chunks=0)

        assert await collect(pool, keep_previous=0) == GcRound(documents=1, chunks=4)
        assert await chunk_versions(pool, created.document_id) == {
            generation_key(GENERATION): [2, 2, 2]
        }
    finally:
        await pool.close()


async def test_a_batch_whose_rows_another_session_took_leaves_the_document_marked(
    pool: asyncpg.Pool[Any], sink: PgVectorSink, database_url: str
) -> None:
    """Version retention, an erase or a retire deletes the rows the collector's next batch
    takes and commits while that batch waits on their locks: the batch removes none of them,
    yet its snapshot held a full batch and more superseded rows are left past it. The
    document stays marked until a batch sees fewer rows than it holds, so none are left."""
    batch = 5
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    await complete(queue, sink, await claim(queue, created.task_id), version_texts(1, 12))
    v2 = await claim(queue, await publish_version(pool, created, 2))
    await complete(queue, sink, v2, version_texts(2, 3))
    async with RowTaker(database_url) as taker:
        # The collector's statement with the collector's arguments on the same rows picks
        # the rows its first batch picks; deleted and not yet committed, that batch's
        # snapshot still holds them and it waits on their row locks.
        args = (created.tenant_id, [created.document_id], 0, batch, CODE_MARK)
        taken = await taker.take(QUERIES["delete_superseded_chunks"], *args)
        assert taken is not None
        assert (len(taken["removed"]), taken["seen"]) == (batch, batch)
        collector = GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=batch))
        done = await collector.collect(max_documents=100)
        await taker.committed()
    assert done.chunks == 12 - batch
    assert await marked(pool) == set()
    assert await chunk_versions(pool, created.document_id) == {
        generation_key(GENERATION): [2, 2, 2]
    }


class _PausedConnection:
    """A real connection whose first statement after BEGIN (whichever list or path runs
    first: it takes the REPEATABLE READ snapshot) reports and then waits to be let go."""

    def __init__(self, conn: Any, snapshot_taken: asyncio.Event, go_on: asyncio.Event) -> None:
        self.unwrapped = conn
        self._snapshot_taken = snapshot_taken
        self._go_on = go_on

    async def _first_pauses(self, query: str, result: Any) -> Any:
        # BEGIN (with the wall's and the path's SET LOCALs) takes no snapshot, nor does a
        # statement before it (the first search reads whether it runs behind the wall).
        if (
            not self._snapshot_taken.is_set()
            and not query.startswith("BEGIN")
            and self.unwrapped.is_in_transaction()
        ):
            self._snapshot_taken.set()
            await self._go_on.wait()
        return result

    async def execute(self, query: str, *args: Any, **options: Any) -> Any:
        return await self._first_pauses(
            query, await self.unwrapped.execute(query, *args, **options)
        )

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self._first_pauses(query, await self.unwrapped.fetch(query, *args))

    async def fetchrow(self, query: str, *args: Any) -> Any:
        return await self._first_pauses(query, await self.unwrapped.fetchrow(query, *args))

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._first_pauses(query, await self.unwrapped.fetchval(query, *args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unwrapped, name)


class _PausingPool:
    """Hands search its pool's connections: the first one paused after its first statement
    that takes a snapshot (the search's own connection; hybrid's second one imports its
    snapshot)."""

    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self.pool = pool
        self.snapshot_taken = asyncio.Event()
        self.go_on = asyncio.Event()
        self._paused_one = False

    def acquire(self, *, timeout: float | None = None) -> _Acquire:
        return _Acquire(self, timeout)

    async def acquire_paused_first(self, acquire_timeout: float | None) -> Any:
        conn = await self.pool.acquire(timeout=acquire_timeout)
        if self._paused_one:
            return conn
        self._paused_one = True
        return _PausedConnection(conn, self.snapshot_taken, self.go_on)

    async def release(self, conn: Any, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 (asyncpg.Pool.release)
        if isinstance(conn, _PausedConnection):
            conn = conn.unwrapped
        await self.pool.release(conn, timeout=timeout)

    def get_idle_size(self) -> int:
        return self.pool.get_idle_size()

    def get_size(self) -> int:
        return self.pool.get_size()

    def get_max_size(self) -> int:
        return self.pool.get_max_size()


class _Acquire:
    """As asyncpg's acquire: awaited (search's connections, the first paused), or ``async
    with`` (the pool's growth in the background: not paused)."""

    def __init__(self, pool: _PausingPool, timeout: float | None) -> None:
        self._pool = pool
        self._timeout = timeout
        self._held: AbstractAsyncContextManager[Any] | None = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._pool.acquire_paused_first(self._timeout).__await__()

    async def __aenter__(self) -> Any:
        self._held = self._pool.pool.acquire(timeout=self._timeout)
        return await self._held.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        assert self._held is not None
        await self._held.__aexit__(*exc)


def searches() -> Iterator[tuple[SearchMode, VectorPath]]:
    yield SearchMode.HYBRID, VectorPath.ANN
    yield SearchMode.VECTOR, VectorPath.ANN
    yield SearchMode.VECTOR, VectorPath.EXACT
    yield SearchMode.KEYWORD, VectorPath.EXACT


@pytest.mark.parametrize(("mode", "path"), list(searches()), ids=lambda v: str(v.value))
async def test_a_search_whose_snapshot_predates_the_switch_still_reads_all_of_the_old_version(
    pool: asyncpg.Pool[Any],
    sink: PgVectorSink,
    settings: RuntimeSettings,
    mode: SearchMode,
    path: VectorPath,
) -> None:
    created = await create_task(pool)

    async def readable_by_all(version: int) -> None:
        # As a publish records it: the version's ACL, served from its switch on.
        await pool.execute(
            "INSERT INTO document_version_acl (tenant_id, document_id, version_number,"
            " principal, permission) VALUES ($1, $2, $3, 'group:all', 'READ')",
            created.tenant_id,
            created.document_id,
            version,
        )

    await readable_by_all(1)
    queue = PgTaskQueue(pool)
    await complete(queue, sink, await claim(queue, created.task_id), version_texts(1))
    v2_task = await publish_version(pool, created, 2)
    await readable_by_all(2)
    v2 = await claim(queue, v2_task)

    paused = _PausingPool(pool)
    search_settings = SearchSettings(
        database_url=settings.database_url, search_exact_max_chunks=EXACT_MAX_CHUNKS[path]
    )

    def searcher(over: asyncpg.Pool[Any]) -> Searcher:
        generation = Generation(EMBEDDER.model, EMBEDDER.dimension)
        return Searcher(EMBEDDER, PgSearchIndex(over, generation, search_settings))

    request = SearchRequest(
        created.tenant_id, "refund clause", ("group:all",), top_k=100, mode=mode
    )
    # The search opens its transaction and takes its snapshot; v2 then switches and commits,
    # and the collector deletes v1 and commits; only then does the search read.
    in_flight = asyncio.create_task(searcher(cast("asyncpg.Pool[Any]", paused)).search(request))
    try:
        async with asyncio.timeout(30):
            await paused.snapshot_taken.wait()
        await complete(queue, sink, v2, version_texts(2, 5))
        collected = await collect(pool, keep_previous=0)
        left = await chunk_versions(pool, created.document_id)
    finally:
        # Whatever failed above, the search's transaction ends (the pool could not close).
        paused.go_on.set()
        old = await in_flight
    assert collected == GcRound(documents=1, chunks=12)
    assert left == {generation_key(GENERATION): [2] * 5}  # v1 is gone, committed

    assert sorted(hit.text for hit in old.results) == sorted(version_texts(1))
    assert {hit.version_number for hit in old.results} == {1}
    new = await searcher(pool).search(request)
    assert sorted(hit.text for hit in new.results) == sorted(version_texts(2, 5))


def long_markdown(version: int, sections: int = 30) -> bytes:
    parts = [f"# Handbook v{version}"]
    for n in range(sections):
        # Most sections unchanged between versions, every third one rewritten.
        edition = version if n % 3 == 0 else 0
        body = " ".join(
            f"Clause {n}.{k}: refunds for order class {k} take {n % 9 + 1 + edition} days."
            for k in range(6)
        )
        parts.append(f"## Section {n}\n\n{body}")
    return "\n\n".join(parts).encode()


class _RecordingSink(PgVectorSink):
    """The real sink, counting the completions that took the streamed path."""

    streamed: int = 0

    def stream_writer(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunk_count: int,
        *,
        search_generation_id: int | None = None,
    ) -> Any:
        self.streamed += 1
        return super().stream_writer(
            lease, generation, chunk_count, search_generation_id=search_generation_id
        )


async def test_the_streamed_completions_document_is_collected_too(
    pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(
        pool, content=long_markdown(1), media_type=MARKDOWN, next_attempt_at=clock.now()
    )
    sink = _RecordingSink(pool, clock=clock)
    indexer = PipelineIndexer(
        PgVersionSource(pool),
        ParsePool(inline=True),
        EMBEDDER,
        sink,
        strategy=chunking_strategy(EMBEDDER, max_tokens=64),
        batching=Batching(batch_size=8),
        # Small numbers, so a document of a hundred-odd chunks takes the streaming path.
        slice_chunks=16,
        stream_above_chunks=40,
    )
    generation = indexer.generation
    await sink.ensure_generation(generation)
    worker = Worker(
        PgTaskQueue(pool, clock=clock),
        indexer,
        tier="standard",
        owner="streamer",
        policy=RetryPolicy(jitter=0),
    )
    assert await worker.run_once() is RunOnceResult.SUCCEEDED
    v1_count = await pool.fetchval(
        "SELECT chunk_count FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    assert v1_count > 40

    await publish_version(pool, created, 2, long_markdown(2))
    assert await worker.run_once() is RunOnceResult.SUCCEEDED
    assert sink.streamed == 2

    current = await pool.fetchrow(
        "SELECT version_number, chunk_count FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    assert current is not None
    assert current["version_number"] == 2
    key = (generation.embedding_model, generation.chunking_strategy)
    # The streamed switch deleted nothing: it marked the document.
    assert await chunk_versions(pool, created.document_id) == {
        key: [1] * v1_count + [2] * current["chunk_count"]
    }
    assert await marked(pool) == {created.document_id}
    assert await pool.fetchval("SELECT count(*) FROM knowledge_chunk_stream") == 0

    # `kb index gc`, as an operator runs it, keeping nothing below the served version.
    collected = await asyncio.to_thread(
        kb_index, "gc", {**service_env, "KB_INDEX_KEEP_PREVIOUS": "0"}
    )
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert f"index gc: {v1_count} chunks collected, 1 documents clean" in collected.stderr
    assert await chunk_versions(pool, created.document_id) == {key: [2] * current["chunk_count"]}
    assert await marked(pool) == set()

    # `kb index check`, as an operator runs it: green, nothing to report.
    checked = await asyncio.to_thread(kb_index, "check", service_env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout == ""
    assert "1 documents, 0 drifted" in checked.stderr


def kb_index(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "index", command],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_collectors_delete_walks_the_primary_key_of_the_tenants_partition(
    pool: asyncpg.Pool[Any],
) -> None:
    created = await create_task(pool)
    # A tenant partition with many documents' chunks and pointers, analysed, as in
    # production.
    others = [uuid.uuid4() for _ in range(2000)]
    await pool.executemany(
        "INSERT INTO document (tenant_id, document_id, title) VALUES ('acme', $1, 'other')",
        [(document_id,) for document_id in others],
    )
    await pool.execute(
        """
        INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                      media_type, sha256, size_bytes, status)
        SELECT 'acme', d, v, '', 'text/plain', sha256(''), 0, 'PUBLISHED'
          FROM unnest($1::uuid[]) AS d, generate_series(1, 3) AS v
        """,
        others,
    )
    await pool.execute(
        """
        INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                                     chunking_strategy, chunk_id, ordinal, text,
                                     content_digest, embedding_dimension, embedding)
        SELECT 'acme', d, v, $2, $3, 'c' || n, n, 'text ' || n, sha256(n::text::bytea), 3,
               '[1,2,3]'
          FROM unnest($1::uuid[]) AS d, generate_series(1, 3) AS v, generate_series(0, 19) AS n
        """,
        others[:200],
        GENERATION.embedding_model,
        GENERATION.chunking_strategy,
    )
    await pool.execute(
        """
        INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                             embedding_model, chunking_strategy, chunk_count)
        SELECT 'acme', d, 3, $2, $3, 20 FROM unnest($1::uuid[]) AS d
        """,
        others,
        GENERATION.embedding_model,
        GENERATION.chunking_strategy,
    )
    # A generation built beside the served one that holds every document too.
    beside = await pool.fetchval(
        """
        INSERT INTO search_generation (provider_profile, embedding_model, dimension,
                                       chunk_max_tokens, chunk_overlap_tokens, chunking_settings)
        VALUES ('default', $1, 3, 64, 0, $2) RETURNING generation_id
        """,
        OTHER_MODEL.embedding_model,
        OTHER_MODEL.chunking_strategy,
    )
    await pool.execute(
        """
        INSERT INTO document_generation_version (tenant_id, document_id, generation_id,
                                                 version_number, chunking_strategy, chunk_count)
        SELECT 'acme', d, $2, 3, $3, 20 FROM unnest($1::uuid[]) AS d
        """,
        others,
        beside,
        OTHER_MODEL.chunking_strategy,
    )
    await pool.execute(
        "ANALYZE knowledge_chunk, document_search_version, document_generation_version,"
        " search_generation"
    )
    partition = await pool.fetchval(
        "SELECT tableoid::regclass::text FROM knowledge_chunk WHERE tenant_id = 'acme' LIMIT 1"
    )
    # As the collector runs it: keep none below the served version, a batch of 5000 rows.
    args = (created.tenant_id, [created.document_id], 0, 5000, CODE_MARK)
    for plan_cache_mode in ("force_custom_plan", "force_generic_plan"):
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL plan_cache_mode = {plan_cache_mode}")
            plan = json.loads(
                await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) " + QUERIES["delete_superseded_chunks"], *args
                )
            )
        scans = list(_plan_nodes(plan[0]["Plan"]))
        [delete] = [node for node in scans if node["Node Type"] == "ModifyTable"]
        assert delete["Operation"] == "Delete", plan_cache_mode
        assert [t["Relation Name"] for t in delete["Target Tables"]] == [partition], plan_cache_mode
        chunk_scans = [
            node
            for node in scans
            if node["Node Type"].endswith("Scan")
            and node.get("Relation Name", "").startswith("knowledge_chunk")
        ]
        # Only the tenant's partition, through its primary key, bounded by the document:
        # the families' versions, the victims, the rows deleted; never a scan of the table.
        assert [node["Relation Name"] for node in chunk_scans] == [partition] * 3, plan_cache_mode
        for scan in chunk_scans:
            assert scan["Node Type"] == "Index Scan", plan_cache_mode
            assert scan["Index Name"] == f"{partition}_pkey", plan_cache_mode
            for column in ("tenant_id", "document_id"):
                assert column in scan["Index Cond"], (plan_cache_mode, scan["Index Cond"])
        # The served versions: the document's pointer and its generations' rows, by their
        # primary keys too.
        for table in ("document_search_version", "document_generation_version"):
            [served] = [node for node in scans if node.get("Relation Name") == table]
            assert served["Index Name"] == f"{table}_pkey", (plan_cache_mode, table)
            assert "document_id" in served["Index Cond"], (plan_cache_mode, table)
        # search_generation (a row per generation, a handful) is the one table read whole.
        assert all(
            node["Node Type"] != "Seq Scan" or node["Relation Name"] == "search_generation"
            for node in scans
        ), plan_cache_mode


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)
