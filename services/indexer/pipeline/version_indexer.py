"""The indexing pipeline for one leased task (docs/architecture.md#the-indexer): load the immutable
version, parse and chunk it off the event loop, reuse the embeddings the index already holds for
unchanged content, embed the rest in batches, and hand the sink's write to the fenced ``complete``.

Chunks come back from the parse process in slices and are embedded slice by slice
(``slices.DocumentRun``), so a huge document is never held whole: its slices are staged
under the attempt's fence and moved into the index by the fenced ``complete``.

It holds no transaction or lock while it works: the version is read in one statement, and
the index is written only by the sink inside ``complete``'s transaction (staged slices wait
outside the index until then).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Final

from services.embedding.batching import Batching
from services.embedding.port import Embedder
from services.index.generations import SearchGeneration
from services.indexer import metrics
from services.indexer.pipeline.chunking import ChunkingStrategy
from services.indexer.pipeline.generations import (
    GenerationPipeline,
    GenerationPipelines,
    TenantShare,
)
from services.indexer.pipeline.generations import index_generation as index_generation
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.parsing.stream import DEFAULT_SLICE_CHUNKS, DocumentBytes
from services.indexer.pipeline.slices import DocumentRun, IndexSink
from services.indexer.pipeline.timed_write import timed
from services.indexer.ports import ClaimGate, IndexingOutcome, StoredVersion, VersionSource
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.indexing.media_types import normalise_media_type
from services.runtime.logging import get_logger
from services.runtime.tracing.spans import mark, span_under

log = get_logger(__name__)

# Documents of up to this many chunks are held in memory and written by the fenced
# complete in one go, as before; longer ones are staged slice by slice (slices.py).
STREAM_ABOVE_CHUNKS: Final = 2048


def chunking_strategy(
    embedder: Embedder, *, max_tokens: int, overlap_tokens: int = 0
) -> ChunkingStrategy:
    """Chunks never longer than the model reads: ``max_tokens`` capped by its input limit
    less the special tokens it adds (a 256-token BERT model reads 254 counted tokens, as
    [CLS] and [SEP] take the other two)."""
    tokenizer = embedder.tokenizer
    return ChunkingStrategy(
        tokenizer=tokenizer,
        max_tokens=min(max_tokens, tokenizer.max_counted_tokens),
        overlap_tokens=overlap_tokens,
    )


class PipelineIndexer:
    """A ``DocumentVersionIndexer``: parse -> chunk -> embed (incrementally) -> sink, one
    slice of chunks at a time (``slices.DocumentRun``)."""

    def __init__(
        self,
        source: VersionSource,
        parse_pool: ParsePool,
        embedder: Embedder,
        sink: IndexSink,
        *,
        strategy: ChunkingStrategy,
        batching: Batching,
        slice_chunks: int = DEFAULT_SLICE_CHUNKS,
        stream_above_chunks: int = STREAM_ABOVE_CHUNKS,
        embedder_ready: asyncio.Future[None] | None = None,
        tenant_share: TenantShare | None = None,
        search: SearchGeneration | None = None,
    ) -> None:
        if slice_chunks < 1 or stream_above_chunks < 0:
            raise ValueError("slice_chunks must be >= 1 and stream_above_chunks >= 0")
        self._source = source
        self._parse_pool = parse_pool
        self._slice_chunks = slice_chunks
        self._stream_above = stream_above_chunks
        # The configured (default) generation's pipeline, built now: the first claim does
        # not wait for anything else. ``use_generations`` adds the others.
        self.default = GenerationPipeline(
            embedder,
            sink,
            strategy=strategy,
            batching=batching,
            embedder_ready=embedder_ready,
            tenant_share=tenant_share,
            search=search,
        )
        self._pipelines: GenerationPipelines | None = None
        self.embedder_ready = embedder_ready
        self.generation = self.default.generation
        # The embedding provider's guard, when it has one: the worker asks it before claiming.
        self.claim_gate: ClaimGate | None = None

    def use_generations(self, pipelines: GenerationPipelines) -> None:
        """From now on each task is indexed by its generation's pipeline (``pipelines``,
        whose default is this indexer's); without it, every task by the default one."""
        assert pipelines.default is self.default
        self._pipelines = pipelines

    async def _pipeline_for(self, lease: Lease) -> GenerationPipeline | None:
        if self._pipelines is None:
            return self.default
        return await self._pipelines.pipeline_for(lease)

    async def index(self, lease: Lease) -> IndexingOutcome:
        ids = lease.log_fields()
        pipeline = await self._pipeline_for(lease)
        if pipeline is None:
            # Its generation is being retired: the task succeeds, writing nothing.
            return IndexingOutcome()
        generation = pipeline.generation
        started = time.perf_counter()
        version = await self._load(lease)
        mark("kb.index.loaded")  # an event on the attempt: a read, not worth a span
        metrics.STAGE_SECONDS.labels(lease.tier, "load").observe(time.perf_counter() - started)
        media_type, size_bytes = version.media_type, version.size_bytes
        # The parse pool takes the bytes and lets them go once sent: a big document is not
        # held here while its chunks stream back.
        content = DocumentBytes(version.content)
        del version

        run = DocumentRun(
            lease,
            generation,
            pipeline.embedder_for(lease.tenant_id),
            pipeline.sink,
            stream_above_chunks=self._stream_above,
        )
        started = time.perf_counter()
        try:
            # Parsing and chunking run together in the parse process: one span for both.
            # The embedding of each slice overlaps it (its spans are the attempt's).
            with span_under(
                "kb.index.parse_and_chunk",
                None,
                attributes={"kb.media_type": media_type, "kb.size_bytes": size_bytes},
            ) as parsing:
                count = await self._parse_pool.stream_chunks(
                    normalise_media_type(media_type),
                    content,
                    document_id=lease.document_id,
                    version_number=lease.version_number,
                    strategy=pipeline.strategy,
                    on_slice=run.take,
                    slice_chunks=self._slice_chunks,
                )
                parsing.set_attribute("kb.chunks", count)
            if not count:
                raise IndexingFailed(ErrorCode.DOCUMENT_EMPTY, "the document has no text to index")
            write = await run.finish()
        except Exception:
            await run.abandon()
            raise
        elapsed = time.perf_counter() - started
        parse_seconds = elapsed - run.embed_seconds - run.stage_seconds
        log.info(
            "pipeline.parsed",
            **ids,
            media_type=media_type,
            size_bytes=size_bytes,
            chunks=count,
            streamed=run.staged,
            duration_ms=round(parse_seconds * 1000, 1),
        )
        log.info(
            "pipeline.embedded",
            **ids,
            chunks=count,
            reused=run.reused,
            embedded=run.embedded,
            embedding_model=generation.embedding_model,
            duration_ms=round(run.embed_seconds * 1000, 1),
        )
        # Parsing and chunking run together in the parse process: one stage for both,
        # the time spent waiting for it (embedding and staging overlap with it).
        metrics.STAGE_SECONDS.labels(lease.tier, "parse").observe(parse_seconds)
        metrics.STAGE_SECONDS.labels(lease.tier, "embed").observe(run.embed_seconds)
        metrics.CHUNKS_PER_TASK.labels(lease.tier, "indexed").observe(count)
        metrics.CHUNKS_PER_TASK.labels(lease.tier, "embedded").observe(run.embedded)
        metrics.EMBEDDING_BATCHES_PER_TASK.labels(lease.tier).observe(
            -(-run.embedded // pipeline.batch_size) if run.embedded else 0
        )
        return IndexingOutcome(write=timed(write, lease, run.stage_seconds))

    async def _load(self, lease: Lease) -> StoredVersion:
        version = await self._source.load(lease.tenant_id, lease.document_id, lease.version_number)
        if version is None:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_VERSION_MISSING,
                f"document {lease.document_id} version {lease.version_number} does not exist",
            )
        if version.content_removed:
            raise IndexingFailed(
                ErrorCode.VERSION_CONTENT_REMOVED,
                f"document {lease.document_id} version {lease.version_number} was superseded"
                " and its content removed by retention",
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


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)
