"""Search over the index (docs/architecture.md#search): the request limits, the result model, and
the reciprocal rank fusion of the vector and keyword lists.

Pure Python: the query embedding comes through the pipeline's ``Embedder`` port, the
candidate lists through a ``SearchIndex`` port (PostgreSQL: ``index_pg``). Every filter
(tenant, current search version, READ ACL) is the index's job and happens before ranking;
this module only orders what the index may show.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from services.embedding.port import Embedder, Vectors
from services.runtime.errors import DependencyUnavailable, KbError
from services.runtime.index_failures import ErrorCode, IndexingFailed

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

    @property
    def depth(self) -> int:
        """How many candidates each list contributes."""
        if self.mode is SearchMode.HYBRID:
            return min(HYBRID_MAX_DEPTH, max(HYBRID_MIN_DEPTH, 2 * self.top_k))
        return self.top_k


@dataclass(frozen=True)
class Generation:
    """The index generation a search read: the embedding model and its dimension (the
    chunking strategy is each document's own, from its search pointer)."""

    embedding_model: str
    dimension: int


@dataclass(frozen=True)
class Candidate:
    """One chunk in one ranked list (rank 1 is the best)."""

    document_id: uuid.UUID
    title: str
    version_number: int
    chunk_id: str
    heading_path: tuple[str, ...]
    text: str
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
class SearchHit:
    document_id: uuid.UUID
    title: str
    version_number: int
    chunk_id: str
    heading_path: tuple[str, ...]
    text: str
    score: float


@dataclass(frozen=True)
class SearchResult:
    results: tuple[SearchHit, ...]
    generation: Generation
    took_ms: float


class SearchIndex(Protocol):
    @property
    def generation(self) -> Generation: ...

    async def candidates(self, request: SearchRequest, query_vector: Vectors | None) -> Candidates:
        """The ranked lists ``request.mode`` needs, each at most ``request.depth`` long, of
        chunks the request's principals may read in the tenant's current search versions."""
        ...


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
    return tuple(
        SearchHit(
            document_id=c.document_id,
            title=c.title,
            version_number=c.version_number,
            chunk_id=c.chunk_id,
            heading_path=c.heading_path,
            text=c.text,
            score=score,
        )
        for c, score in fused[: request.top_k]
    )


# --- the use case --------------------------------------------------------------------------


class QueryEmbeddingUnavailable(DependencyUnavailable):
    """The embedding provider could not embed the query now (503; retry later)."""

    code = "EMBEDDING_UNAVAILABLE"


_RETRIABLE_EMBEDDING_CODES: Final = frozenset(
    {
        ErrorCode.EMBEDDING_RATE_LIMITED,
        ErrorCode.EMBEDDING_TIMEOUT,
        ErrorCode.EMBEDDING_UNAVAILABLE,
    }
)


class Searcher:
    def __init__(self, embedder: Embedder, index: SearchIndex) -> None:
        if (embedder.model, embedder.dimension) != (
            index.generation.embedding_model,
            index.generation.dimension,
        ):
            raise ValueError("the query embedder and the index must be of the same generation")
        self._embedder = embedder
        self._index = index

    @property
    def generation(self) -> Generation:
        return self._index.generation

    async def search(self, request: SearchRequest) -> SearchResult:
        started = time.perf_counter()
        query_vector = await self._embed(request.query) if request.mode.uses_vector else None
        candidates = await self._index.candidates(request, query_vector)
        results = rank_results(request, candidates)
        took_ms = (time.perf_counter() - started) * 1000.0
        return SearchResult(results, self._index.generation, round(took_ms, 3))

    async def _embed(self, query: str) -> Vectors:
        try:
            vectors = await self._embedder.embed([query])
        except IndexingFailed as error:
            if error.code in _RETRIABLE_EMBEDDING_CODES:
                raise QueryEmbeddingUnavailable(error.message, code=error.code) from error
            # The provider answered nonsense or another model: not the caller's fault and
            # not fixed by retrying; a 500 with the stable code.
            raise KbError(error.message, code=error.code) from error
        return vectors
