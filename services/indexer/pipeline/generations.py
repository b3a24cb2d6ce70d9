"""One pipeline per search generation (docs/architecture.md#index-generations): a task is
indexed with the embedder and the chunking of the generation it builds -- the one it names,
else its tenant's serving one, else the default.

The default generation's pipeline is built at start (the indexer claims within a second of
starting, as before); another generation's is built the first time a task of it is claimed,
then kept: its embedder (from its provider profile, guarded like the default's for a
remote provider), its chunking strategy (its chunk tokens, capped by its model), its
request queue, and the sink bound to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from services.embedding.batching import Batching
from services.embedding.coalescing import CoalescingEmbedder, RequestStats
from services.embedding.port import Embedder, Vectors
from services.embedding.tokens import TokenCounter, load_token_counter
from services.index.generation import IndexGeneration
from services.index.generations import SearchGeneration
from services.indexer import metrics
from services.indexer.pipeline.chunking import ChunkingStrategy
from services.indexer.pipeline.slices import BatchEmbedder, IndexSink
from services.indexer.ports import InTransaction
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

if TYPE_CHECKING:
    from services.embedding.guard.guard import ProviderGuard
    from services.embedding.settings import EmbeddingSettings
    from services.indexer.chunk import Chunk

log = get_logger(__name__)

# Waits until the tenant may spend this many more tokens of the provider's quota.
TenantShare = Callable[[str, int], Awaitable[None]]


def index_generation(embedder: Embedder, strategy: ChunkingStrategy) -> IndexGeneration:
    """What a version is indexed as: the model, its dimension and the chunking strategy."""
    return IndexGeneration(
        embedding_model=embedder.model,
        dimension=embedder.dimension,
        chunking_strategy=strategy.strategy_id,
        chunking_code=strategy.code,
    )


class _TenantShared:
    """One task's texts through the shared queue, after its tenant's share of the quota
    lets them go: a request mixes tenants, so a tenant is charged here, per task."""

    def __init__(
        self, inner: CoalescingEmbedder, tenant_id: str, share: TenantShare, count: TokenCounter
    ) -> None:
        self._inner = inner
        self._tenant_id = tenant_id
        self._share = share
        self._count = count

    @property
    def batch_size(self) -> int:
        return self._inner.batch_size

    async def embed_all(self, texts: Sequence[str]) -> Vectors:
        await self._share(self._tenant_id, sum(self._count(text) for text in texts))
        return await self._inner.embed_all(texts)


class BoundSink:
    """The sink with every write bound to one search generation (``IndexSink``)."""

    def __init__(self, sink: Any, search_generation_id: int) -> None:
        self._sink = sink
        self._id = search_generation_id

    async def known_embeddings(
        self, tenant_id: str, generation: IndexGeneration, digests: Sequence[bytes]
    ) -> Mapping[bytes, Vectors]:
        found: Mapping[bytes, Vectors] = await self._sink.known_embeddings(
            tenant_id, generation, digests
        )
        return found

    def writer(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: Vectors,
    ) -> InTransaction:
        write: InTransaction = self._sink.writer(
            lease, generation, chunks, embeddings, search_generation_id=self._id
        )
        return write

    async def stage(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: Vectors,
        *,
        first: bool,
    ) -> None:
        await self._sink.stage(lease, generation, chunks, embeddings, first=first)

    async def discard_stream(self, lease: Lease) -> None:
        await self._sink.discard_stream(lease)

    def stream_writer(
        self, lease: Lease, generation: IndexGeneration, chunk_count: int
    ) -> InTransaction:
        write: InTransaction = self._sink.stream_writer(
            lease, generation, chunk_count, search_generation_id=self._id
        )
        return write


def batching_of(embedding: EmbeddingSettings) -> Batching:
    """How a profile's texts go out in requests: its KB_EMBEDDING_BATCH_SIZE,
    KB_EMBEDDING_MAX_BATCH_TOKENS, KB_EMBEDDING_BATCH_LINGER_SECONDS and
    KB_EMBEDDING_MAX_REQUESTS_IN_FLIGHT, the same for the default pipeline and the others."""
    return Batching(
        batch_size=embedding.batch_size,
        max_batch_tokens=embedding.max_batch_tokens,
        linger_seconds=embedding.batch_linger_seconds,
        max_requests_in_flight=embedding.max_requests_in_flight,
    )


def tenant_share_of(
    guard: ProviderGuard | None, embedding: EmbeddingSettings
) -> TenantShare | None:
    """A tenant's share of a remote provider's quota, when its guard keeps shares
    (KB_EMBEDDING_RATE_TENANT_SHARE set); None: the tenants' requests share it as they come."""
    if guard is None or embedding.rate_tenant_share is None:
        return None
    return guard.tenant_share


class GenerationPipeline:
    """What indexes one generation: its chunking strategy, its embedder's shared request
    queue (the tasks it runs at once share requests, whose token budgets are counted the way
    the model counts) and the sink its writes go through."""

    def __init__(
        self,
        embedder: Embedder,
        sink: IndexSink,
        *,
        strategy: ChunkingStrategy,
        batching: Batching,
        embedder_ready: asyncio.Future[None] | None = None,
        tenant_share: TenantShare | None = None,
        search: SearchGeneration | None = None,
    ) -> None:
        if batching.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.strategy = strategy
        self.batch_size = batching.batch_size
        self.search = search
        self.sink: IndexSink = sink if search is None else BoundSink(sink, search.generation_id)
        self.requests = CoalescingEmbedder(
            embedder,
            batching,
            count_tokens=(
                load_token_counter(strategy.tokenizer)
                if batching.max_batch_tokens is not None
                else None
            ),
            on_request=_observe_request,
            ready=embedder_ready,
        )
        self.generation = index_generation(embedder, strategy)
        self._tenant_share = tenant_share
        self._count_tokens = load_token_counter(strategy.tokenizer) if tenant_share else None

    def embedder_for(self, tenant_id: str) -> BatchEmbedder:
        if self._tenant_share is None or self._count_tokens is None:
            return self.requests
        return _TenantShared(self.requests, tenant_id, self._tenant_share, self._count_tokens)


# A generation's pipeline, built (and its embedder warmed up), with what closes it.
BuiltPipeline = tuple[GenerationPipeline, Callable[[], Awaitable[None]]]
BuildPipeline = Callable[[SearchGeneration], Awaitable[BuiltPipeline]]
LookUp = Callable[[Lease], Awaitable[SearchGeneration | None]]


class GenerationPipelines:
    """The pipeline of each task's generation: the default one, built at start, and the
    others, built lazily (once however many tasks of it arrive at once) and cached."""

    def __init__(self, default: GenerationPipeline, look_up: LookUp, build: BuildPipeline) -> None:
        assert default.search is not None
        self.default = default
        self._look_up = look_up
        self._build = build
        self._built: dict[int, asyncio.Task[BuiltPipeline]] = {}

    async def pipeline_for(self, lease: Lease) -> GenerationPipeline | None:
        """The pipeline of the generation ``lease``'s task builds; None when that
        generation is being retired (the task has nothing left to build)."""
        default = self.default
        search = await self._look_up(lease)
        if search is None or search.generation_id == _id(default):
            return default
        if not search.active:
            log.info(
                "task.generation_retired",
                **lease.log_fields(),
                generation_id=search.generation_id,
                state=search.state,
            )
            return None
        building = self._built.get(search.generation_id)
        if building is None:
            building = asyncio.create_task(self._build_logged(search))
            self._built[search.generation_id] = building
        try:
            # Shielded: one task's cancellation (its lease lost) does not stop a build
            # that other tasks wait for.
            pipeline, _ = await asyncio.shield(building)
        except Exception as error:
            if self._built.get(search.generation_id) is building:
                del self._built[search.generation_id]  # the next task tries again
            if not isinstance(error, KbError):
                raise
            raise IndexingFailed(
                ErrorCode.EMBEDDING_UNAVAILABLE,
                f"{search.describe()} cannot be indexed by this indexer: {error.message}",
            ) from error
        return pipeline

    async def _build_logged(self, search: SearchGeneration) -> BuiltPipeline:
        built = await self._build(search)
        log.info(
            "generation_pipeline.built",
            generation_id=search.generation_id,
            embedding_model=built[0].generation.embedding_model,
            chunking_strategy=built[0].generation.chunking_strategy,
        )
        return built

    async def aclose(self) -> None:
        """Closes every lazily built pipeline's embedder (the default's is its builder's)."""
        building, self._built = list(self._built.values()), {}
        for task in building:
            if not task.done():
                task.cancel()
            try:
                _, close = await task
            except (Exception, asyncio.CancelledError):
                continue  # a failed or cancelled build holds nothing to close
            await close()


def _id(pipeline: GenerationPipeline) -> int | None:
    return None if pipeline.search is None else pipeline.search.generation_id


def _observe_request(stats: RequestStats) -> None:
    metrics.EMBEDDING_REQUEST_INPUTS.observe(stats.inputs)
    metrics.EMBEDDING_REQUEST_DOCUMENTS.observe(stats.callers)
