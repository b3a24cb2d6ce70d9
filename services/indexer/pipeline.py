"""The indexing pipeline for one leased task (DESIGN §6): load the immutable version, parse
and chunk it off the event loop, reuse the embeddings the index already holds for unchanged
content, embed the rest in batches, and hand the sink's write to the fenced ``complete``.

It holds no transaction or lock while it works: the version is read in one statement, and
the only write is the sink's, inside ``complete``'s transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from services.indexer import metrics
from services.indexer.chunking import Chunk, ChunkingStrategy
from services.indexer.embedding.batching import embed_batched
from services.indexer.embedding.port import Embedder, Vectors
from services.indexer.ports import IndexingOutcome, InTransaction, StoredVersion, VersionSource
from services.indexer.sink_pgvector import IndexGeneration
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.indexer.tokens import load_token_counter
from services.runtime.logging import get_logger
from services.runtime.media_types import normalise_media_type
from services.runtime.transaction import Transaction

log = get_logger(__name__)

# Digests asked of the index per query: bounded parameter size for very long documents.
_KNOWN_LOOKUP_BATCH = 2000
# Embedding requests sent back to back before the event loop is given a turn.
_REQUESTS_PER_WAVE = 8


class ChunkParser(Protocol):
    """What the pipeline needs of ``parsing.pool.ParsePool``."""

    async def parse_and_chunk(
        self,
        media_type: str,
        content: bytes,
        *,
        document_id: uuid.UUID,
        version_number: int,
        strategy: ChunkingStrategy,
    ) -> list[Chunk]: ...


class IndexSink(Protocol):
    """What the pipeline needs of ``sink_pgvector.PgVectorSink``."""

    async def known_embeddings(
        self, tenant_id: str, generation: IndexGeneration, digests: Sequence[bytes]
    ) -> Mapping[bytes, Vectors]: ...

    def writer(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: Vectors,
    ) -> InTransaction: ...


def chunking_strategy(
    embedder: Embedder, *, max_tokens: int, overlap_tokens: int = 0
) -> ChunkingStrategy:
    """Chunks never longer than the model reads: ``max_tokens`` capped by its input limit."""
    tokenizer = embedder.tokenizer
    return ChunkingStrategy(
        tokenizer=tokenizer,
        max_tokens=min(max_tokens, tokenizer.max_input_tokens),
        overlap_tokens=overlap_tokens,
    )


def index_generation(embedder: Embedder, strategy: ChunkingStrategy) -> IndexGeneration:
    """What a version is indexed as: the model, its dimension and the chunking strategy."""
    return IndexGeneration(
        embedding_model=embedder.model,
        dimension=embedder.dimension,
        chunking_strategy=strategy.strategy_id,
    )


class PipelineIndexer:
    """A ``DocumentVersionIndexer``: parse -> chunk -> embed (incrementally) -> sink."""

    def __init__(
        self,
        source: VersionSource,
        parse_pool: ChunkParser,
        embedder: Embedder,
        sink: IndexSink,
        *,
        strategy: ChunkingStrategy,
        batch_size: int,
        max_batch_tokens: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self._source = source
        self._parse_pool = parse_pool
        self._embedder = embedder
        self._sink = sink
        self._strategy = strategy
        self._batch_size = batch_size
        self._max_batch_tokens = max_batch_tokens
        # Token budgets per request are counted the way the model counts.
        self._count_tokens = (
            load_token_counter(strategy.tokenizer) if max_batch_tokens is not None else None
        )
        self.generation = index_generation(embedder, strategy)

    async def index(self, lease: Lease) -> IndexingOutcome:
        ids = {
            "task_id": str(lease.task_id),
            "tenant_id": lease.tenant_id,
            "document_id": str(lease.document_id),
            "version_number": lease.version_number,
        }
        started = time.perf_counter()
        version = await self._load(lease)
        metrics.STAGE_SECONDS.labels(lease.tier, "load").observe(time.perf_counter() - started)

        started = time.perf_counter()
        chunks = await self._parse_pool.parse_and_chunk(
            normalise_media_type(version.media_type),
            version.content,
            document_id=lease.document_id,
            version_number=lease.version_number,
            strategy=self._strategy,
        )
        log.info(
            "pipeline.parsed",
            **ids,
            media_type=version.media_type,
            size_bytes=version.size_bytes,
            chunks=len(chunks),
            duration_ms=_ms_since(started),
        )
        # Parsing and chunking run together in the parse process: one stage for both.
        metrics.STAGE_SECONDS.labels(lease.tier, "parse").observe(time.perf_counter() - started)
        del version  # the bytes are not needed any more: a big document frees them now
        if not chunks:
            raise IndexingFailed(ErrorCode.DOCUMENT_EMPTY, "the document has no text to index")

        started = time.perf_counter()
        embeddings, reused, embedded = await self._embeddings(lease.tenant_id, chunks)
        log.info(
            "pipeline.embedded",
            **ids,
            chunks=len(chunks),
            reused=reused,
            embedded=embedded,
            embedding_model=self.generation.embedding_model,
            duration_ms=_ms_since(started),
        )
        metrics.STAGE_SECONDS.labels(lease.tier, "embed").observe(time.perf_counter() - started)
        metrics.CHUNKS_PER_TASK.labels(lease.tier, "indexed").observe(len(chunks))
        metrics.CHUNKS_PER_TASK.labels(lease.tier, "embedded").observe(embedded)
        metrics.EMBEDDING_BATCHES_PER_TASK.labels(lease.tier).observe(
            -(-embedded // self._batch_size) if embedded else 0
        )
        # Building the write's records is CPU work proportional to the document: off the
        # loop, which must stay free for heartbeats.
        write = await asyncio.to_thread(
            self._sink.writer, lease, self.generation, chunks, embeddings
        )

        async def timed_write(transaction: Transaction) -> None:
            began = time.perf_counter()
            await write(transaction)
            metrics.STAGE_SECONDS.labels(lease.tier, "sink").observe(time.perf_counter() - began)

        return IndexingOutcome(write=timed_write)

    async def _load(self, lease: Lease) -> StoredVersion:
        version = await self._source.load(lease.tenant_id, lease.document_id, lease.version_number)
        if version is None:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_VERSION_MISSING,
                f"document {lease.document_id} version {lease.version_number} does not exist",
            )
        # The stored bytes must be the ones published: a mismatch is corruption, and
        # indexing it would make wrong content searchable.
        if len(version.content) != version.size_bytes:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_PARSE_FAILED,
                f"content is {len(version.content)} bytes, {version.size_bytes} recorded",
            )
        if hashlib.sha256(version.content).digest() != version.sha256:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_PARSE_FAILED, "content does not match its recorded sha256"
            )
        return version

    async def _embeddings(
        self, tenant_id: str, chunks: Sequence[Chunk]
    ) -> tuple[Vectors, int, int]:
        """One row per chunk, in order; returns (rows, chunks reused, texts embedded).

        Content the index already holds for this tenant and generation is reused; of the
        rest, each distinct digest is embedded once (repeated boilerplate included). Every
        vector goes straight to its rows: a long document holds its vectors once."""
        dimension = self.generation.dimension
        rows = np.empty((len(chunks), dimension), dtype=np.float32)
        rows_of: dict[bytes, list[int]] = {}
        for row, chunk in enumerate(chunks):
            rows_of.setdefault(chunk.content_digest, []).append(row)
        digests = list(rows_of)
        reused = 0
        known: set[bytes] = set()
        for start in range(0, len(digests), _KNOWN_LOOKUP_BATCH):
            found = await self._sink.known_embeddings(
                tenant_id, self.generation, digests[start : start + _KNOWN_LOOKUP_BATCH]
            )
            for digest, vector in found.items():
                if digest in rows_of and np.shape(vector) == (dimension,):
                    rows[rows_of[digest]] = vector
                    reused += len(rows_of[digest])
                    known.add(digest)
        missing = [digest for digest in digests if digest not in known]
        wave = self._batch_size * _REQUESTS_PER_WAVE
        for start in range(0, len(missing), wave):
            part = missing[start : start + wave]
            # Every request's answer is checked there (count, dimension, finite values).
            vectors = await embed_batched(
                self._embedder,
                [chunks[rows_of[digest][0]].embedding_input for digest in part],
                batch_size=self._batch_size,
                max_batch_tokens=self._max_batch_tokens,
                count_tokens=self._count_tokens,
            )
            for digest, vector in zip(part, vectors, strict=True):
                rows[rows_of[digest]] = vector
            # A turn for the loop even when the embedder never yields (one computing on
            # the loop): a long document must not starve the heartbeat of its lease.
            await asyncio.sleep(0)
        return rows, reused, len(missing)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)
