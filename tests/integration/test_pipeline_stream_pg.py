"""The streaming path for large documents on real PostgreSQL: slices staged under the
attempt's fence (knowledge_chunk_stream), moved into the index only by the fenced complete.
The same chunk set as the in-memory path; a lost lease writes nothing to the index; a
crashed attempt leaves nothing visible, its leftovers are cleaned and ignored, and the
re-run completes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import numpy as np
import pytest

from services.embedding.batching import Batching
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Vectors
from services.embedding.tokens import approximate_tokens
from services.indexer.pipeline.chunking import chunk_sections
from services.indexer.pipeline.parsing import parse_document
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.source_pg import PgVersionSource
from services.indexer.pipeline.version_indexer import PipelineIndexer, chunking_strategy
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.sink.stream import StagedChunksMissing
from services.indexer.task import Lease, TaskStatus
from services.runtime.errors import LeaseLost
from services.runtime.indexing.media_types import MARKDOWN
from services.runtime.messaging.events import DOCUMENT_SEARCH_VERSION_SWITCHED
from tests.support.clock import ManualClock
from tests.support.tasks import CreatedTask, create_task

pytestmark = pytest.mark.integration

LEASE = 30.0
MAX_TOKENS = 64
# Small numbers, so a document of a few hundred chunks takes the streaming path.
STREAMING = {"slice_chunks": 16, "stream_above_chunks": 40}


def long_markdown(sections: int = 60) -> bytes:
    parts = ["# Handbook"]
    for n in range(sections):
        body = " ".join(
            f"Clause {n}.{k}: refunds for order class {k} take {n % 9 + 1} days." for k in range(6)
        )
        parts.append(f"## Section {n}\n\n{body}\n\nThe same footer on every page.")
    return "\n\n".join(parts).encode()


def pipeline(
    pool: asyncpg.Pool[Any], clock: ManualClock, embedder: Any = None, **options: Any
) -> PipelineIndexer:
    embedder = embedder or HashingEmbedder(dimension=64)
    return PipelineIndexer(
        PgVersionSource(pool),
        options.pop("parse_pool", None) or ParsePool(inline=True),
        embedder,
        PgVectorSink(pool, clock=clock),
        strategy=chunking_strategy(embedder, max_tokens=MAX_TOKENS),
        batching=Batching(batch_size=8),
        **{**STREAMING, **options},
    )


async def expected_rows(content: bytes, created: CreatedTask) -> list[tuple[Any, ...]]:
    """What the in-memory path computes for the version: its chunks, each with its vector."""
    embedder = HashingEmbedder(dimension=64)
    chunks = chunk_sections(
        parse_document(MARKDOWN, content),
        document_id=created.document_id,
        version_number=1,
        strategy=chunking_strategy(embedder, max_tokens=MAX_TOKENS),
        count_tokens=approximate_tokens,
    )
    vectors = await embedder.embed([chunk.embedding_input for chunk in chunks])
    return [
        (c.chunk_id, c.ordinal, list(c.heading_path), c.text, c.content_digest, list(v))
        for c, v in zip(chunks, vectors, strict=True)
    ]


async def index_rows(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> list[tuple[Any, ...]]:
    rows = await pool.fetch(
        "SELECT chunk_id, ordinal, heading_path, text, content_digest, embedding"
        "  FROM knowledge_chunk WHERE document_id = $1 ORDER BY ordinal",
        document_id,
    )
    return [
        (
            r["chunk_id"],
            r["ordinal"],
            r["heading_path"],
            r["text"],
            bytes(r["content_digest"]),
            list(r["embedding"].to_numpy()),
        )
        for r in rows
    ]


async def visible(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> tuple[int, int, int]:
    """(chunks, pointers, switch events) of the document."""
    return (
        await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", document_id
        ),
        await pool.fetchval(
            "SELECT count(*) FROM document_search_version WHERE document_id = $1", document_id
        ),
        await pool.fetchval(
            "SELECT count(*) FROM outbox WHERE event_type = $1 AND aggregate_key LIKE $2",
            DOCUMENT_SEARCH_VERSION_SWITCHED,
            f"%{document_id}%",
        ),
    )


async def staged(pool: asyncpg.Pool[Any], task_id: uuid.UUID) -> dict[int, int]:
    rows = await pool.fetch(
        "SELECT lease_attempt, count(*) AS n FROM knowledge_chunk_stream WHERE task_id = $1"
        " GROUP BY lease_attempt",
        task_id,
    )
    return {row["lease_attempt"]: row["n"] for row in rows}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC))


async def claim(queue: PgTaskQueue, task_id: uuid.UUID, owner: str) -> Lease:
    [lease] = await queue.claim("standard", owner, lease_seconds=LEASE)
    assert lease.task_id == task_id
    return lease


async def test_a_large_document_streams_through_a_worker_and_gives_the_in_memory_chunk_set(
    pool: asyncpg.Pool[Any], clock: ManualClock
) -> None:
    content = long_markdown()
    created = await create_task(
        pool, content=content, media_type=MARKDOWN, next_attempt_at=clock.now()
    )
    # The real parse process: the slices cross its pipe.
    parse_pool = ParsePool(workers=1)
    indexer = pipeline(pool, clock, parse_pool=parse_pool)
    try:
        await PgVectorSink(pool).ensure_generation(indexer.generation)
        worker = Worker(
            PgTaskQueue(pool, clock=clock),
            indexer,
            tier="standard",
            owner="streamer",
            policy=RetryPolicy(jitter=0),
        )
        assert await worker.run_once() is RunOnceResult.SUCCEEDED
    finally:
        await parse_pool.aclose()

    expected = await expected_rows(content, created)
    assert len(expected) > 3 * STREAMING["stream_above_chunks"]  # it did stream
    got = await index_rows(pool, created.document_id)
    assert [row[:5] for row in got] == [row[:5] for row in expected]
    assert all(np.allclose(g[5], e[5], atol=1e-6) for g, e in zip(got, expected, strict=True))
    assert await visible(pool, created.document_id) == (len(expected), 1, 1)
    current = await pool.fetchrow(
        "SELECT version_number, chunk_count FROM document_search_version WHERE document_id = $1",
        created.document_id,
    )
    assert current is not None
    assert (current["version_number"], current["chunk_count"]) == (1, len(expected))
    assert await staged(pool, created.task_id) == {}


async def test_a_lost_lease_on_the_streaming_path_writes_nothing_to_the_index(
    pool: asyncpg.Pool[Any], clock: ManualClock
) -> None:
    content = long_markdown()
    created = await create_task(
        pool, content=content, media_type=MARKDOWN, next_attempt_at=clock.now()
    )
    queue = PgTaskQueue(pool, clock=clock)
    indexer = pipeline(pool, clock)
    await PgVectorSink(pool).ensure_generation(indexer.generation)
    old = await claim(queue, created.task_id, owner="slow")

    # The slow worker has staged some slices when its lease is taken over.
    staged_some = asyncio.Event()
    taken_over = asyncio.Event()
    sink: PgVectorSink = indexer.default.sink  # type: ignore[assignment]
    real_stage = sink.stage
    stages = 0

    async def stage(*args: Any, **kwargs: Any) -> None:
        nonlocal stages
        stages += 1
        if stages == 3:
            staged_some.set()
            await taken_over.wait()
        await real_stage(*args, **kwargs)

    sink.stage = stage  # type: ignore[method-assign]
    slow = asyncio.create_task(indexer.index(old))
    await staged_some.wait()
    assert await staged(pool, created.task_id) == {old.lease_attempt: 48}
    clock.advance(LEASE + 1)
    new = await claim(queue, created.task_id, owner="rescuer")
    taken_over.set()
    # Its next slice finds the fence gone: nothing more is staged, the attempt ends.
    with pytest.raises(LeaseLost):
        await slow
    sink.stage = real_stage  # type: ignore[method-assign]

    # Even a completion with what it had staged is refused before the sink runs.
    with pytest.raises(LeaseLost):
        await queue.complete(old, in_transaction=sink.stream_writer(old, indexer.generation, 48))
    assert await visible(pool, created.document_id) == (0, 0, 0)
    task = await queue.get(created.task_id)
    assert task is not None
    assert (task.status, task.lease_owner) == (TaskStatus.RUNNING, "rescuer")

    # The rescuer streams the document again: the old attempt's rows are deleted at its
    # first slice, never read, and the index gets exactly the in-memory chunk set.
    outcome = await indexer.index(new)
    assert outcome.write is not None
    assert set(await staged(pool, created.task_id)) == {new.lease_attempt}
    await queue.complete(new, in_transaction=outcome.write)
    expected = await expected_rows(content, created)
    assert [row[:5] for row in await index_rows(pool, created.document_id)] == [
        row[:5] for row in expected
    ]
    assert await visible(pool, created.document_id) == (len(expected), 1, 1)
    assert await staged(pool, created.task_id) == {}


class StallingEmbedder(HashingEmbedder):
    """Answers ``before_stall`` requests, then waits forever (a worker about to be killed)."""

    def __init__(self, before_stall: int) -> None:
        super().__init__(dimension=64)
        self.left = before_stall
        self.stalled = asyncio.Event()

    async def embed(self, texts: Sequence[str]) -> Vectors:
        if self.left == 0:
            self.stalled.set()
            await asyncio.Event().wait()
        self.left -= 1
        return await super().embed(texts)


async def test_a_crashed_streaming_attempt_leaves_nothing_visible_and_the_rerun_completes(
    pool: asyncpg.Pool[Any], clock: ManualClock
) -> None:
    content = long_markdown()
    created = await create_task(
        pool, content=content, media_type=MARKDOWN, next_attempt_at=clock.now()
    )
    queue = PgTaskQueue(pool, clock=clock)
    stalling = StallingEmbedder(before_stall=12)
    crashed = pipeline(pool, clock, embedder=stalling)
    await PgVectorSink(pool).ensure_generation(crashed.generation)
    first = await claim(queue, created.task_id, owner="crashed")
    attempt = asyncio.create_task(crashed.index(first))
    await stalling.stalled.wait()
    # The worker dies mid-stream: no cleanup of its own runs (a cancelled task, like a
    # killed process, gets no chance to delete what it staged).
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    leftovers = await staged(pool, created.task_id)
    assert leftovers.keys() == {first.lease_attempt}
    assert await visible(pool, created.document_id) == (0, 0, 0)

    clock.advance(LEASE + 1)
    second = await claim(queue, created.task_id, owner="rescuer")
    rerun = pipeline(pool, clock)
    outcome = await rerun.index(second)
    assert outcome.write is not None
    await queue.complete(second, in_transaction=outcome.write)
    expected = await expected_rows(content, created)
    got = await index_rows(pool, created.document_id)
    assert [row[:5] for row in got] == [row[:5] for row in expected]
    assert await visible(pool, created.document_id) == (len(expected), 1, 1)
    assert await staged(pool, created.task_id) == {}


async def test_staged_rows_lost_before_completion_fail_the_attempt_retriably(
    pool: asyncpg.Pool[Any], clock: ManualClock
) -> None:
    content = long_markdown()
    created = await create_task(
        pool, content=content, media_type=MARKDOWN, next_attempt_at=clock.now()
    )
    queue = PgTaskQueue(pool, clock=clock)
    indexer = pipeline(pool, clock)
    await PgVectorSink(pool).ensure_generation(indexer.generation)
    lease = await claim(queue, created.task_id, owner="w")
    outcome = await indexer.index(lease)
    assert outcome.write is not None
    # The staging table is UNLOGGED: a database crash empties it.
    await pool.execute(
        "DELETE FROM knowledge_chunk_stream WHERE task_id = $1 AND ordinal > 7", created.task_id
    )
    with pytest.raises(StagedChunksMissing) as raised:
        await queue.complete(lease, in_transaction=outcome.write)
    assert raised.value.retriable
    assert await visible(pool, created.document_id) == (0, 0, 0)
    task = await queue.get(created.task_id)
    assert task is not None
    assert task.status is TaskStatus.RUNNING  # rolled back whole: the attempt may fail/retry
