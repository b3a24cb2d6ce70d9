"""The real indexing pipeline over a test's database, for integration tests and benchmarks:
the sink registers the generation once, as ``kb indexer run`` does at start."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg

from services.embedding.batching import Batching
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Embedder, PassedThroughIdentity, Vectors
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.source_pg import PgVersionSource
from services.indexer.pipeline.version_indexer import PipelineIndexer, chunking_strategy
from services.indexer.ports import Clock
from services.indexer.sink.pgvector import PgVectorSink


class RecordingEmbedder(PassedThroughIdentity):
    """Any embedder, with every request's texts recorded (what a provider was sent)."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.requests: list[list[str]] = []

    @property
    def texts(self) -> list[str]:
        return [text for request in self.requests for text in request]

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.requests.append(list(texts))
        return await self.inner.embed(texts)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.asynccontextmanager
async def running_pipeline(
    pool: asyncpg.Pool[Any],
    *,
    embedder: Embedder | None = None,
    parse_pool: ParsePool | None = None,
    max_tokens: int = 128,
    batch_size: int = 32,
    clock: Clock | None = None,
    **streaming: Any,
) -> AsyncIterator[PipelineIndexer]:
    """The pipeline with a hashing embedder (fast) unless told otherwise, and an inline
    parse pool unless one is given; closed on the way out. ``streaming``: the pipeline's
    ``slice_chunks`` / ``stream_above_chunks``."""
    embedder = embedder or HashingEmbedder(dimension=64)
    parse_pool = parse_pool or ParsePool(inline=True)
    sink = PgVectorSink(pool, clock=clock)
    indexer = PipelineIndexer(
        PgVersionSource(pool),
        parse_pool,
        embedder,
        sink,
        strategy=chunking_strategy(embedder, max_tokens=max_tokens),
        batching=Batching(batch_size=batch_size),
        **streaming,
    )
    try:
        await sink.ensure_generation(indexer.generation)
        yield indexer
    finally:
        await parse_pool.aclose()
        await embedder.aclose()
