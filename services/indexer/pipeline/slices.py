"""One document's chunks as they stream in from the parse process: each slice gets its
embeddings (reused from the index where it can, else from the embedder), then is held in
memory while the document is small, or staged in the database once it is large.

Small documents -- nearly all of them -- are written exactly as before: all chunks and
vectors in one fenced ``complete`` (``IndexSink.writer``). A document past
``stream_above_chunks`` chunks is staged slice by slice under its attempt's fence
(``IndexSink.stage``) and moved into the index by the fenced ``complete``
(``IndexSink.stream_writer``), so the indexer holds a slice or two of it at any time, never
the whole document's texts and vectors.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import numpy as np

from services.embedding.port import Vectors
from services.index.generation import IndexGeneration
from services.indexer.chunk import Chunk
from services.indexer.ports import InTransaction
from services.indexer.task import Lease
from services.runtime.logging import get_logger

log = get_logger(__name__)

# Digests asked of the index per query: bounded parameter size.
_KNOWN_LOOKUP_BATCH: Final = 2000
# Embedding requests sent back to back before the event loop is given a turn.
_REQUESTS_PER_WAVE: Final = 8
# Chunks whose write's records are built on the loop: for fewer, handing the work to a
# thread (and its result back) costs more than the work.
_RECORDS_ON_LOOP_MAX_CHUNKS: Final = 32
# Vectors of recently seen content kept per document, so that content repeated within a
# large document (a page footer, boilerplate) is embedded once: 4096 x 384 floats = 6 MiB.
RECENT_VECTORS: Final = 4096


class IndexSink(Protocol):
    """What the pipeline needs of ``sink.pgvector.PgVectorSink``."""

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

    async def stage(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: Vectors,
        *,
        first: bool,
    ) -> None: ...

    async def discard_stream(self, lease: Lease) -> None: ...

    def stream_writer(
        self, lease: Lease, generation: IndexGeneration, chunk_count: int
    ) -> InTransaction: ...


class BatchEmbedder(Protocol):
    """What a run needs of ``services.embedding.coalescing.CoalescingEmbedder``: any number
    of texts embedded, in requests of ``batch_size`` it shares with the other documents
    being indexed."""

    @property
    def batch_size(self) -> int: ...

    async def embed_all(self, texts: Sequence[str]) -> Vectors: ...


class DocumentRun:
    """Takes one document's slices in order (``take``), then gives the fenced write
    (``finish``). Not shared between documents."""

    def __init__(
        self,
        lease: Lease,
        generation: IndexGeneration,
        embedder: BatchEmbedder,
        sink: IndexSink,
        *,
        stream_above_chunks: int,
    ) -> None:
        self._lease = lease
        self._generation = generation
        self._embedder = embedder
        self._sink = sink
        self._stream_above = stream_above_chunks
        self._chunks: list[Chunk] = []
        self._vectors: list[Vectors] = []
        self._recent: OrderedDict[bytes, Vectors] = OrderedDict()
        self.staged = False
        self.chunks = 0
        self.reused = 0
        self.embedded = 0
        self.embed_seconds = 0.0
        self.stage_seconds = 0.0

    async def take(self, part: list[Chunk]) -> None:
        began = time.perf_counter()
        vectors = await self._embeddings(part)
        self.embed_seconds += time.perf_counter() - began
        self.chunks += len(part)
        if not self.staged and self.chunks <= self._stream_above:
            self._chunks.extend(part)
            self._vectors.append(vectors)
            return
        began = time.perf_counter()
        if not self.staged:
            # Past the threshold: what was held goes to staging first, in order.
            log.info(
                "pipeline.streaming",
                task_id=str(self._lease.task_id),
                lease_attempt=self._lease.lease_attempt,
                held_chunks=len(self._chunks),
            )
            held, held_vectors = self._chunks, self._vectors
            self._chunks, self._vectors = [], []
            if held:
                await self._sink.stage(
                    self._lease, self._generation, held, np.vstack(held_vectors), first=True
                )
            await self._sink.stage(self._lease, self._generation, part, vectors, first=not held)
            self.staged = True
        else:
            await self._sink.stage(self._lease, self._generation, part, vectors, first=False)
        self.stage_seconds += time.perf_counter() - began

    async def finish(self) -> InTransaction:
        """The write to run inside the fenced complete (at least one chunk was taken)."""
        if self.staged:
            return self._sink.stream_writer(self._lease, self._generation, self.chunks)
        chunks, vectors = self._chunks, np.vstack(self._vectors)
        self._chunks, self._vectors = [], []
        if len(chunks) <= _RECORDS_ON_LOOP_MAX_CHUNKS:
            return self._sink.writer(self._lease, self._generation, chunks, vectors)
        # Building a larger write's records is CPU work proportional to the document: off
        # the loop, which must stay free for heartbeats.
        return await asyncio.to_thread(
            self._sink.writer, self._lease, self._generation, chunks, vectors
        )

    async def abandon(self) -> None:
        """The attempt failed: its staged rows (if any) are deleted, best effort (the
        task's next attempt deletes them anyway)."""
        if not self.staged:
            return
        try:
            await self._sink.discard_stream(self._lease)
        except Exception as error:
            log.warning(
                "pipeline.stream_discard_failed",
                task_id=str(self._lease.task_id),
                error=f"{type(error).__name__}: {error}",
            )

    async def _embeddings(self, part: Sequence[Chunk]) -> Vectors:
        """One row per chunk of the slice, in order. Content seen recently in this document,
        or held by the index for this tenant and generation, is reused; of the rest, each
        distinct digest is embedded once."""
        dimension = self._generation.dimension
        rows = np.empty((len(part), dimension), dtype=np.float32)
        rows_of: dict[bytes, list[int]] = {}
        for row, chunk in enumerate(part):
            rows_of.setdefault(chunk.content_digest, []).append(row)
        unknown: list[bytes] = []
        for digest, where in rows_of.items():
            vector = self._recent.get(digest)
            if vector is None:
                unknown.append(digest)
                continue
            self._recent.move_to_end(digest)
            rows[where] = vector
            self.reused += len(where)
        missing: list[bytes] = []
        for start in range(0, len(unknown), _KNOWN_LOOKUP_BATCH):
            asked = unknown[start : start + _KNOWN_LOOKUP_BATCH]
            found = await self._sink.known_embeddings(
                self._lease.tenant_id, self._generation, asked
            )
            for digest in asked:
                vector = found.get(digest)
                if vector is None or np.shape(vector) != (dimension,):
                    missing.append(digest)
                    continue
                rows[rows_of[digest]] = vector
                self.reused += len(rows_of[digest])
                self._remember(digest, rows[rows_of[digest][0]])
        wave = self._embedder.batch_size * _REQUESTS_PER_WAVE
        for start in range(0, len(missing), wave):
            batch = missing[start : start + wave]
            # Every request's answer is checked there (count, dimension, finite values). Its
            # requests are spans of the queue's, which the current span (the parse) links to.
            vectors = await self._embedder.embed_all(
                [part[rows_of[digest][0]].embedding_input for digest in batch]
            )
            for digest, vector in zip(batch, vectors, strict=True):
                rows[rows_of[digest]] = vector
                self._remember(digest, vector)
            # A turn for the loop even when the embedder never yields (one computing on
            # the loop): a long document must not starve the heartbeat of its lease.
            await asyncio.sleep(0)
        self.embedded += len(missing)
        return rows

    def _remember(self, digest: bytes, vector: Vectors) -> None:
        self._recent[digest] = np.array(vector, dtype=np.float32)
        if len(self._recent) > RECENT_VECTORS:
            self._recent.popitem(last=False)
