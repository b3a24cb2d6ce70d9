"""Search over the index (docs/architecture.md#search): the request limits, the result model, and
the reciprocal rank fusion of the vector and keyword lists.

Pure Python: the query embedding comes through the pipeline's ``Embedder`` port, the
candidate lists through a ``SearchIndex`` port (PostgreSQL: ``index_pg``). Between the two
phases the request's search slot may go to a quieter tenant
(``services/runtime/fair_share/phases.py``). Every filter
(tenant, current search version, READ ACL) is the index's job and happens before ranking;
this module only orders what the index may show.

When the query cannot be embedded -- the provider throttles, is down or answers a page that
is no embeddings answer, or the embedding takes longer than the searcher's timeout -- a
hybrid search answers from the keyword list alone and says so (``SearchResult.degraded``);
a vector search fails with ``QueryEmbeddingUnavailable`` (503, with when to retry).
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Protocol

from services.embedding.port import Embedder, Vectors
from services.runtime.errors import DependencyUnavailable, KbError
from services.runtime.fair_share.phases import between_search_phases, search_slot
from services.runtime.indexing.index_failures import (
    PROVIDER_FAILURE_CODES,
    ErrorCode,
    IndexingFailed,
    redact,
)
from services.runtime.logging import get_logger
from services.runtime.pg.records import copied
from services.runtime.tenancy.principals import normalise_principals
from services.runtime.tracing.spans import TENANT_ID, Attributes, span_under
from services.search.metrics import TIMEOUT_REASON, count_degraded

log = get_logger(__name__)

# --- request limits (the API validates against these; 422 beyond them) -------------------

MAX_QUERY_CHARS: Final = 1000
MIN_TOP_K: Final = 1
MAX_TOP_K: Final = 100
DEFAULT_TOP_K: Final = 10
MAX_PRINCIPALS: Final = 1000
MAX_PRINCIPAL_CHARS: Final = 200
MAX_FILTER_DOCUMENTS: Final = 1000
MAX_HEADING_PREFIX_DEPTH: Final = 16
MAX_HEADING_CHARS: Final = 500

# Reciprocal rank fusion constant (Cormack et al., 2009): damps the weight of the very top
# ranks so that one list cannot dominate the fused order.
RRF_K: Final = 60
# How deep each list goes before fusion: a chunk ranked just below top_k in both lists
# should still be able to win, so hybrid reads deeper than it answers. Twice the default
# topK ranks as well (nDCG@10) on both quality sets as reading 50 deep, which made the
# keyword list fall back to its any-word and rarest-word stages for more queries, each
# reading many more chunks.
HYBRID_MIN_DEPTH: Final = 20
HYBRID_MAX_DEPTH: Final = 200
# Hybrid fuses a keyword candidate only if it holds at least this share of the query's
# words (weighted by rarity): a chunk sharing just "can" and "I" with a question ranks in the
# keyword list, and fused by rank it would outrank the vector list's best answer.
# The keyword list's weight in the fusion, the vector list's being 1: exact terms (codes,
# names) lift a chunk the vector list also found, without a keyword-only hit displacing the
# vector list's answers to a paraphrase. Both chosen by `bench.search_quality --fusion-grid`
# on the two quality sets (bench/results/search_quality.md): at some of the other values
# tried, hybrid ranked below vector alone on the labelled set's 'english' tenant.
HYBRID_MIN_KEYWORD_COVERAGE: Final = 0.75
HYBRID_KEYWORD_WEIGHT: Final = 0.3

# How long a search waits for its query's embedding (KB_SEARCH_QUERY_EMBED_TIMEOUT_SECONDS)
# before hybrid answers from the keyword list alone and vector answers 503.
DEFAULT_QUERY_EMBED_TIMEOUT_SECONDS: Final = 2.0
# Retry-After of a 503 when the provider named no time (a timeout, a 5xx without one).
DEFAULT_RETRY_AFTER_SECONDS: Final = 5


class SearchMode(enum.StrEnum):
    HYBRID = "hybrid"
    VECTOR = "vector"
    KEYWORD = "keyword"

    @property
    def uses_vector(self) -> bool:
        return self is not SearchMode.KEYWORD

    @property
    def uses_keyword(self) -> bool:
        return self is not SearchMode.VECTOR


@dataclass(frozen=True)
class SearchFilter:
    document_ids: tuple[uuid.UUID, ...] | None = None
    # Chunks whose heading path starts with these headings, e.g. ("Refund policy",).
    heading_prefix: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SearchRequest:
    tenant_id: str
    query: str
    principals: tuple[str, ...]
    top_k: int = DEFAULT_TOP_K
    mode: SearchMode = SearchMode.HYBRID
    filter: SearchFilter = field(default_factory=SearchFilter)
    # The highest WAL position of the request's `after` tokens (services/search/replicas.py):
    # answered only by a server that has replayed it. None: any server in rotation.
    read_after: int | None = None

    @property
    def depth(self) -> int:
        """How many candidates each list contributes."""
        if self.mode is SearchMode.HYBRID:
            return min(HYBRID_MAX_DEPTH, max(HYBRID_MIN_DEPTH, 2 * self.top_k))
        return self.top_k


@dataclass(frozen=True)
class Generation:
    """The index generation a search read: the embedding model and its dimension (the
    chunking strategy is each document's own, from its search pointer), and the search
    generation serving the tenant (``search_generation``; None in a database that has none
    yet, where search reads the configured model: services/search/serving.py)."""

    embedding_model: str
    dimension: int
    generation_id: int | None = None


@dataclass(frozen=True)
class FoundChunk:
    """A chunk as search shows it: its document's version, its place in it, its text."""

    document_id: uuid.UUID
    title: str
    version_number: int
    chunk_id: str
    heading_path: tuple[str, ...]
    text: str
    # The version's stored upload's media type (text/markdown, application/pdf, ...): what
    # a retriever names as the hit's source format (issue 45).
    media_type: str = field(kw_only=True)


@dataclass(frozen=True)
class Candidate(FoundChunk):
    """One chunk in one ranked list (rank 1 is the best)."""

    rank: int
    score: float
    # Keyword list: the share of the query's (rarity-weighted) words the chunk holds.
    coverage: float | None = None

    @property
    def key(self) -> tuple[uuid.UUID, str]:
        return (self.document_id, self.chunk_id)


@dataclass(frozen=True)
class Candidates:
    """Both lists, read in one statement (one snapshot): never two versions of a document."""

    vector: Sequence[Candidate] = ()
    keyword: Sequence[Candidate] = ()


@dataclass(frozen=True)
class SearchHit(FoundChunk):
    score: float


class Degraded(enum.StrEnum):
    """How a search answered with less than it was asked for."""

    # Hybrid, from the keyword list alone: the query could not be embedded.
    KEYWORD_ONLY = "keyword-only"


@dataclass(frozen=True)
class SearchResult:
    results: tuple[SearchHit, ...]
    generation: Generation
    took_ms: float
    # None: the answer is what the request's mode asked for.
    degraded: Degraded | None = None
    # The server the search read (primary, or a replica's name); None when not routed.
    read_from: str | None = None


class SearchIndex(Protocol):
    @property
    def generation(self) -> Generation: ...

    async def candidates(self, request: SearchRequest, query_vector: Vectors | None) -> Candidates:
        """The ranked lists ``request.mode`` needs, each at most ``request.depth`` long, of
        chunks the request's principals may read in the tenant's current search versions."""
        ...


class SearchService(Protocol):
    """What the search route calls: one ``Searcher``, or the tenant's serving generation's
    (services/search/serving.py)."""

    async def search(self, request: SearchRequest) -> SearchResult: ...


# --- fusion --------------------------------------------------------------------------------


def reciprocal_rank_fusion(
    lists: Iterable[Sequence[Candidate]],
    *,
    k: int = RRF_K,
    weights: Sequence[float] | None = None,
) -> list[tuple[Candidate, float]]:
    """Each chunk scores ``sum(weight / (k + rank))`` over the lists it appears in (weight 1
    unless given per list); a chunk in several lists appears once. Ties are broken by
    document id and chunk id, so the order is the same on every run."""
    scores: dict[tuple[uuid.UUID, str], float] = {}
    first_seen: dict[tuple[uuid.UUID, str], Candidate] = {}
    for position, ranked in enumerate(lists):
        weight = 1.0 if weights is None else weights[position]
        seen_here: set[tuple[uuid.UUID, str]] = set()
        for candidate in ranked:
            if candidate.key in seen_here:
                continue  # a list names each chunk once; a repeat must not count twice
            seen_here.add(candidate.key)
            scores[candidate.key] = scores.get(candidate.key, 0.0) + weight / (k + candidate.rank)
            first_seen.setdefault(candidate.key, candidate)
    ordered = sorted(scores.items(), key=lambda item: (-item[1], str(item[0][0]), item[0][1]))
    return [(first_seen[key], score) for key, score in ordered]


def rank_results(
    request: SearchRequest,
    candidates: Candidates,
    *,
    min_keyword_coverage: float = HYBRID_MIN_KEYWORD_COVERAGE,
    keyword_weight: float = HYBRID_KEYWORD_WEIGHT,
) -> tuple[SearchHit, ...]:
    """The answer: one list as ranked by the index, or both fused by reciprocal rank."""
    if request.mode is SearchMode.HYBRID:
        keyword = [
            c
            for c in candidates.keyword
            if c.coverage is None or c.coverage >= min_keyword_coverage
        ]
        fused = reciprocal_rank_fusion([candidates.vector, keyword], weights=(1.0, keyword_weight))
    else:
        ranked = candidates.vector if request.mode is SearchMode.VECTOR else candidates.keyword
        fused = [(c, c.score) for c in sorted(ranked, key=lambda c: c.rank)]
    return tuple(copied(SearchHit, c, score=score) for c, score in fused[: request.top_k])


# --- the use case --------------------------------------------------------------------------


class QueryEmbeddingUnavailable(DependencyUnavailable):
    """The embedding provider could not embed the query now (503; retry later): made from
    the provider's ``failure``, whose code, message and Retry-After it answers with
    (EMBEDDING_TIMEOUT when the searcher's timeout ran out); ``reason`` is that code, or
    ``"timeout"`` for the searcher's own timeout."""

    code = "EMBEDDING_UNAVAILABLE"

    def __init__(self, failure: IndexingFailed, *, reason: str | None = None) -> None:
        super().__init__(failure.message, code=failure.code)
        self.reason = reason or failure.code
        self.retry_after_seconds = failure.retry_after_seconds

    @property
    def retry_after(self) -> int:
        """Whole seconds for a Retry-After header: the provider's time rounded up, or
        DEFAULT_RETRY_AFTER_SECONDS when it named none."""
        seconds = self.retry_after_seconds
        if seconds is None or not math.isfinite(seconds):
            return DEFAULT_RETRY_AFTER_SECONDS
        return max(1, math.ceil(seconds))


class Searcher:
    def __init__(
        self,
        embedder: Embedder,
        index: SearchIndex,
        *,
        query_embed_timeout_seconds: float = DEFAULT_QUERY_EMBED_TIMEOUT_SECONDS,
    ) -> None:
        if (embedder.model, embedder.dimension) != (
            index.generation.embedding_model,
            index.generation.dimension,
        ):
            raise ValueError("the query embedder and the index must be of the same generation")
        if not query_embed_timeout_seconds > 0:
            raise ValueError("the query embedding timeout must be positive")
        self._embedder = embedder
        self._index = index
        self._embed_timeout = query_embed_timeout_seconds

    @property
    def generation(self) -> Generation:
        return self._index.generation

    async def search(self, request: SearchRequest) -> SearchResult:
        """The request's fair-share slot held while it embeds and reads (already held when
        called by services/search/serving.py), given back before the answer is written."""
        async with search_slot():
            return await self._search(request)

    async def _search(self, request: SearchRequest) -> SearchResult:
        # Ids and the request's shape only: never the query's text nor the principals.
        attributes = {TENANT_ID: request.tenant_id, "kb.search.mode": request.mode.value}
        with span_under("kb.search", None, attributes=attributes) as span:
            result = await self._search_traced(request)
            outcome: Attributes = {"kb.search.results": len(result.results)}
            if result.degraded is not None:
                outcome["kb.search.degraded"] = result.degraded.value
            span.set_attributes(outcome)
            return result

    async def _search_traced(self, request: SearchRequest) -> SearchResult:
        started = time.perf_counter()
        # Compared in the form publish stores ACLs in (NFC, trimmed): "group:café" spelt with
        # a combining accent, or with a stray space, is the principal the ACL names.
        request = replace(request, principals=normalise_principals(request.principals))
        query_vector: Vectors | None = None
        degraded: Degraded | None = None
        if request.mode.uses_vector:
            # Each phase -- the query's embedding, then the database's lists -- may start
            # after a quieter tenant's search, if one waits for the slot this one holds.
            await between_search_phases()
            try:
                query_vector = await self._embed(request.query)
            except QueryEmbeddingUnavailable as error:
                if request.mode is not SearchMode.HYBRID:
                    raise
                # The keyword list does not need the provider: answer from it alone, ranked
                # as a keyword search ranks it, and say so.
                self._degraded(request, error)
                request = replace(request, mode=SearchMode.KEYWORD)
                degraded = Degraded.KEYWORD_ONLY
        await between_search_phases()
        candidates = await self._index.candidates(request, query_vector)
        if request.mode is SearchMode.HYBRID:
            with span_under("kb.search.fuse", None):
                results = rank_results(request, candidates)
        else:
            # One list, already ranked by the index: nothing is fused, so no span (a span
            # costs as much as this step; BENCHMARKS.md#tracing-on-vs-off-issue-46).
            results = rank_results(request, candidates)
        took_ms = (time.perf_counter() - started) * 1000.0
        return SearchResult(results, self._index.generation, round(took_ms, 3), degraded)

    async def _embed(self, query: str) -> Vectors:
        # The searcher's own bound, whatever the embedder: a provider's request timeout
        # suits indexing (seconds to spare), not a person waiting for an answer.
        deadline = asyncio.timeout(self._embed_timeout)
        attributes = {
            "gen_ai.operation.name": "embeddings",
            "gen_ai.request.model": self._embedder.model,
        }
        try:
            with span_under("kb.search.embed_query", None, attributes=attributes):
                async with deadline:
                    vectors = await self._embedder.embed([query])
        except TimeoutError as error:
            if not deadline.expired():
                raise  # not ours: the embedder's own bug, answered as today (500)
            late = f"the query was not embedded within {self._embed_timeout:g} s"
            raise QueryEmbeddingUnavailable(
                IndexingFailed(ErrorCode.EMBEDDING_TIMEOUT, late), reason=TIMEOUT_REASON
            ) from error
        except IndexingFailed as error:
            if error.code in PROVIDER_FAILURE_CODES:
                raise QueryEmbeddingUnavailable(error) from error
            # The provider answered nonsense or another model: not the caller's fault and
            # not fixed by retrying; a 500 with the stable code.
            raise KbError(error.message, code=error.code) from error
        return vectors

    @staticmethod
    def _degraded(request: SearchRequest, error: QueryEmbeddingUnavailable) -> None:
        count_degraded(error.reason)
        log.warning(
            "search.degraded",
            tenant_id=request.tenant_id,
            mode=request.mode.value,
            degraded=Degraded.KEYWORD_ONLY.value,
            reason=error.reason,
            error_code=error.code,
            retry_after_seconds=error.retry_after_seconds,
            error=redact(error.message),
        )
