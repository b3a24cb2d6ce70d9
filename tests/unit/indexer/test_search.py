"""Search domain: reciprocal rank fusion, list depth, and the use case over fakes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Vectors
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.errors import KbError
from services.search.searcher import (
    HYBRID_KEYWORD_WEIGHT,
    HYBRID_MIN_KEYWORD_COVERAGE,
    RRF_K,
    Candidate,
    Candidates,
    Generation,
    QueryEmbeddingUnavailable,
    Searcher,
    SearchMode,
    SearchRequest,
    rank_results,
    reciprocal_rank_fusion,
)

DOC = uuid.UUID("00000000-0000-0000-0000-00000000000d")


def candidate(chunk: str, rank: int, score: float = 0.0, doc: uuid.UUID = DOC) -> Candidate:
    return Candidate(
        doc, "Title", 1, chunk, ("H",), f"text {chunk}", rank, score, media_type="text/plain"
    )


def test_rrf_matches_a_hand_computed_example() -> None:
    vector = [candidate("A", 1), candidate("B", 2), candidate("C", 3)]
    keyword = [candidate("C", 1), candidate("B", 2), candidate("D", 3)]

    fused = reciprocal_rank_fusion([vector, keyword])

    # By hand, k = 60:  C = 1/63 + 1/61 = 124/3843 = 0.0322665
    #                   B = 1/62 + 1/62 =   1/31   = 0.0322581
    #                   A = 1/61                    = 0.0163934
    #                   D = 1/63                    = 0.0158730
    assert RRF_K == 60
    assert [c.chunk_id for c, _ in fused] == ["C", "B", "A", "D"]
    assert [score for _, score in fused] == pytest.approx([124 / 3843, 1 / 31, 1 / 61, 1 / 63])


def test_rrf_names_each_chunk_once_even_if_a_list_repeats_it() -> None:
    fused = reciprocal_rank_fusion([[candidate("A", 1), candidate("A", 2)], [candidate("A", 5)]])
    assert [c.chunk_id for c, _ in fused] == ["A"]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 65)


def test_rrf_breaks_ties_by_document_then_chunk() -> None:
    first, second = uuid.UUID(int=1), uuid.UUID(int=2)
    fused = reciprocal_rank_fusion(
        [
            [candidate("z", 1, doc=second)],
            [candidate("y", 1, doc=first), candidate("x", 1, doc=second)],
        ]
    )
    assert [(c.document_id, c.chunk_id) for c, _ in fused] == [
        (first, "y"),
        (second, "x"),
        (second, "z"),
    ]


def test_same_chunk_id_in_two_documents_is_two_results() -> None:
    fused = reciprocal_rank_fusion(
        [[candidate("c", 1, doc=uuid.UUID(int=1))], [candidate("c", 1, doc=uuid.UUID(int=2))]]
    )
    assert len(fused) == 2


@pytest.mark.parametrize(
    ("mode", "top_k", "depth"),
    [
        (SearchMode.VECTOR, 7, 7),
        (SearchMode.KEYWORD, 100, 100),
        (SearchMode.HYBRID, 1, 20),
        (SearchMode.HYBRID, 10, 20),
        (SearchMode.HYBRID, 40, 80),
        (SearchMode.HYBRID, 100, 200),
    ],
)
def test_hybrid_reads_deeper_than_it_answers(mode: SearchMode, top_k: int, depth: int) -> None:
    request = SearchRequest("acme", "q", ("p",), top_k=top_k, mode=mode)
    assert request.depth == depth


def test_single_list_modes_keep_the_index_order_and_score_and_cut_at_top_k() -> None:
    lists = Candidates(
        vector=[candidate("b", 2, 0.5), candidate("a", 1, 0.9), candidate("c", 3, 0.1)],
        keyword=[candidate("k", 1, 3.0)],
    )
    request = SearchRequest("acme", "q", ("p",), top_k=2, mode=SearchMode.VECTOR)
    assert [(h.chunk_id, h.score) for h in rank_results(request, lists)] == [("a", 0.9), ("b", 0.5)]
    keyword = SearchRequest("acme", "q", ("p",), top_k=2, mode=SearchMode.KEYWORD)
    assert [(h.chunk_id, h.score) for h in rank_results(keyword, lists)] == [("k", 3.0)]


def test_hybrid_fuses_only_keyword_candidates_covering_enough_of_the_query() -> None:
    def keyword_hit(chunk: str, rank: int, coverage: float) -> Candidate:
        return replace(candidate(chunk, rank, 1.0), coverage=coverage)

    lists = Candidates(
        vector=[candidate("answer", 1, 0.9), candidate("weak", 9, 0.1)],
        # "weak" shares only a common word with the query: fused, its two ranks would put
        # it above the vector list's answer.
        keyword=[
            keyword_hit("weak", 1, HYBRID_MIN_KEYWORD_COVERAGE / 2),
            keyword_hit("exact", 2, HYBRID_MIN_KEYWORD_COVERAGE),
        ],
    )
    hybrid = SearchRequest("acme", "q", ("p",), top_k=3, mode=SearchMode.HYBRID)
    fused = rank_results(hybrid, lists, keyword_weight=1.0)
    assert [h.chunk_id for h in fused] == ["answer", "exact", "weak"]
    assert fused[2].score == pytest.approx(1 / (RRF_K + 9))
    # The keyword list's weight scales its share: at the default, a keyword-only hit ranks
    # below a vector hit of a similar rank.
    weighted = rank_results(hybrid, lists)
    assert [h.chunk_id for h in weighted] == ["answer", "weak", "exact"]
    assert weighted[2].score == pytest.approx(HYBRID_KEYWORD_WEIGHT / (RRF_K + 2))
    # Keyword mode ranks every candidate the index returned.
    keyword = SearchRequest("acme", "q", ("p",), top_k=3, mode=SearchMode.KEYWORD)
    assert [h.chunk_id for h in rank_results(keyword, lists)] == ["weak", "exact"]


class FakeIndex:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.vectors: list[Vectors | None] = []

    async def candidates(self, request: SearchRequest, query_vector: Vectors | None) -> Candidates:
        self.vectors.append(query_vector)
        return Candidates(vector=[candidate("v", 1, 0.9)], keyword=[candidate("k", 1, 2.0)])


class FailingEmbedder(HashingEmbedder):
    def __init__(self, code: str) -> None:
        super().__init__(8)
        self.code = code

    async def embed(self, texts: Sequence[str]) -> Vectors:
        raise IndexingFailed(self.code, "provider says no")


async def test_keyword_search_does_not_embed_and_vector_search_embeds_the_query() -> None:
    embedder = HashingEmbedder(8)
    index = FakeIndex(Generation(embedder.model, 8))
    searcher = Searcher(embedder, index)

    keyword = await searcher.search(
        SearchRequest("acme", "refund", ("p",), mode=SearchMode.KEYWORD)
    )
    hybrid = await searcher.search(SearchRequest("acme", "refund", ("p",)))

    assert index.vectors[0] is None
    assert index.vectors[1] is not None
    np.testing.assert_array_equal(index.vectors[1], embedder.embed_sync(["refund"]))
    assert [h.chunk_id for h in keyword.results] == ["k"]
    # Both first in their lists: the vector list weighs more (HYBRID_KEYWORD_WEIGHT < 1).
    assert [h.chunk_id for h in hybrid.results] == ["v", "k"]
    assert hybrid.generation == Generation("hashing-v1-8", 8)
    assert hybrid.took_ms >= 0


async def test_a_searcher_refuses_an_embedder_of_another_generation() -> None:
    with pytest.raises(ValueError, match="same generation"):
        Searcher(HashingEmbedder(8), FakeIndex(Generation("hashing-v1-8", 16)))


@pytest.mark.parametrize(
    ("code", "retriable"),
    [
        (ErrorCode.EMBEDDING_RATE_LIMITED, True),
        (ErrorCode.EMBEDDING_TIMEOUT, True),
        (ErrorCode.EMBEDDING_UNAVAILABLE, True),
        (ErrorCode.EMBEDDING_RESPONSE_INVALID, False),
    ],
)
async def test_embedding_failures_keep_their_code(code: str, retriable: bool) -> None:
    embedder = FailingEmbedder(code)
    searcher = Searcher(embedder, FakeIndex(Generation(embedder.model, 8)))
    # Vector mode: hybrid answers from the keyword list instead (tests/unit/search).
    with pytest.raises(KbError) as raised:
        await searcher.search(SearchRequest("acme", "q", ("p",), mode=SearchMode.VECTOR))
    assert raised.value.code == code
    assert isinstance(raised.value, QueryEmbeddingUnavailable) is retriable
    assert raised.value.http_status == (503 if retriable else 500)


def test_the_search_sql_is_specialised_per_model_with_literals() -> None:
    from services.index.ann import model_predicate, vector_expression
    from services.search.statements import (
        KEYWORD_STATEMENT,
        VECTOR_STATEMENT,
        specialised_search_sql,
    )

    model = "all-MiniLM-L6-v2-onnx-int8"
    sql = specialised_search_sql(model, 384)
    assert "-- slot:" not in sql  # every slot filled or left out
    assert sql.count(vector_expression(384, "c.embedding")) == 2
    assert sql.count(model_predicate(model, "c.embedding_model")) == 1
    assert sql.count(model_predicate(model, "s.embedding_model")) == 1
    assert specialised_search_sql(model, 384) is sql  # cached
    assert specialised_search_sql(model, 384, VECTOR_STATEMENT) == sql
    keyword = specialised_search_sql(model, 384, KEYWORD_STATEMENT)
    assert "-- slot:" not in keyword
    assert model_predicate(model, "c.embedding_model") in keyword
    assert model_predicate(model, "s.embedding_model") in keyword
    assert "::vector" not in keyword
    with pytest.raises(ValueError, match="characters outside"):
        specialised_search_sql("model' OR true --", 384)


def test_the_vector_statement_holds_the_vector_list_and_its_exact_twin_uses_no_index() -> None:
    from services.index.ann import vector_expression
    from services.search.statements import (
        FRAGMENTS,
        KEYWORD_STATEMENT,
        VECTOR_STATEMENT,
        VectorPath,
        slot_choices,
        specialised_search_sql,
    )

    def indented(name: str, by: int) -> str:
        return "\n".join(" " * by + line if line else line for line in FRAGMENTS[name].splitlines())

    # The vector statement's list is the path's fragment, each bounded by the depth.
    for path, fragment in (
        (VectorPath.ANN, "vector_list_ann"),
        (VectorPath.EXACT, "vector_list_exact"),
    ):
        assert slot_choices(VECTOR_STATEMENT, path)["vector_list"] == fragment
        assert "LIMIT $5" in FRAGMENTS[fragment]
    assert FRAGMENTS[VECTOR_STATEMENT].count("    -- slot: vector_list\n") == 1
    # Both lists search the very same chunks.
    assert FRAGMENTS["vector_list_ann"].count(indented("searchable_chunks", 4)) == 1
    assert FRAGMENTS[KEYWORD_STATEMENT].count(indented("searchable_chunks", 4)) == 1
    exact = specialised_search_sql("m", 384, VECTOR_STATEMENT, VectorPath.EXACT)
    assert vector_expression(384, "c.embedding") not in exact
    assert exact.count("c.embedding <=> $6::vector") == 2
    # The exact list names the model's dimension (migrations/0017's index is partial on it).
    assert exact.count("c.embedding_dimension = 384") == 1
    ann = specialised_search_sql("m", 384, VECTOR_STATEMENT, VectorPath.ANN)
    # Ordered by the model's HNSW expression (its own line in the text: a slot).
    words = " ".join(ann.split())
    assert words.count(vector_expression(384, "c.embedding") + " <=> $6::vector") == 2
    assert "embedding_dimension" not in ann


def test_only_the_keyword_list_of_broad_principals_probes_each_candidate() -> None:
    from services.search.statements import (
        KEYWORD_STATEMENT,
        VECTOR_STATEMENT,
        VectorPath,
        specialised_search_sql,
    )

    def probes(name: str, path: VectorPath) -> int:
        return specialised_search_sql("m", 384, name, path).count("OFFSET 0")

    # The version and the ACL: both EXISTS stay subqueries.
    assert probes(KEYWORD_STATEMENT, VectorPath.ANN) == 2
    assert probes(KEYWORD_STATEMENT, VectorPath.EXACT) == 0
    assert probes(VECTOR_STATEMENT, VectorPath.ANN) == 0
    assert probes(VECTOR_STATEMENT, VectorPath.EXACT) == 0


def test_only_the_exact_vector_list_lists_the_readable_documents_first() -> None:
    from services.search.statements import (
        FRAGMENTS,
        KEYWORD_STATEMENT,
        VECTOR_STATEMENT,
        VectorPath,
        specialised_search_sql,
    )

    def indented(name: str, by: int) -> str:
        return "\n".join(" " * by + line if line else line for line in FRAGMENTS[name].splitlines())

    # Twins: the same chunks' columns, tenant, model and request filters, of the current
    # search version -- one text for both.
    for twin in ("searchable_chunks", "searchable_chunks_listed"):
        assert FRAGMENTS[twin].count(FRAGMENTS["filtered_chunks"]) == 1
        assert FRAGMENTS[twin].count(indented("current_search_version", 9)) == 1
    listing = "s.document_id = ANY (ARRAY("
    assert listing in FRAGMENTS["searchable_chunks_listed"]
    assert listing not in FRAGMENTS["searchable_chunks"]
    exact = specialised_search_sql("m", 384, VECTOR_STATEMENT, VectorPath.EXACT)
    assert exact.count(listing) == 1
    assert "FROM document_acl a" in exact
    assert exact.count("document_search_version s") == 1
    for name, path in [
        (VECTOR_STATEMENT, VectorPath.ANN),
        (KEYWORD_STATEMENT, VectorPath.ANN),
        (KEYWORD_STATEMENT, VectorPath.EXACT),
    ]:
        assert listing not in specialised_search_sql("m", 384, name, path)


@pytest.mark.parametrize("any_word", [True, False])
@pytest.mark.parametrize("rarest_word", [True, False])
def test_the_keyword_list_scans_only_for_the_kinds_its_terms_can_find(
    any_word: bool, rarest_word: bool
) -> None:
    from services.search.statements import (
        KEYWORD_STATEMENT,
        VECTOR_STATEMENT,
        KeywordKinds,
        VectorPath,
        specialised_search_sql,
    )

    kinds = KeywordKinds(any_word=any_word, rarest_word=rarest_word)
    for path in VectorPath:
        sql = specialised_search_sql("m", 384, KEYWORD_STATEMENT, path, kinds)
        # Each kind reads the chunks once; one left out reads nothing (WHERE false).
        assert sql.count("FROM keyword_searchable c") == 1 + any_word + rarest_word
        assert ("AND c.search_document @@ $7::tsquery" in sql) is any_word
        assert ("AND c.search_document @@ $8::tsquery" in sql) is rarest_word
        assert sql.count("NULL::tsvector AS search_document") == 2 - (any_word + rarest_word)
        # The kinds' CTEs stay, so that the rest of the statement reads as before.
        assert "keyword_any_word AS MATERIALIZED (" in sql
        assert "keyword_rarest_word AS MATERIALIZED (" in sql
        # Typed even when no kind reads them.
        assert "$7::tsquery AS any_word, $8::tsquery AS rarest_word" in sql
    if not (any_word and rarest_word):
        with pytest.raises(ValueError, match="only the keyword list"):
            specialised_search_sql("m", 384, VECTOR_STATEMENT, VectorPath.ANN, kinds)
    assert KeywordKinds.of("'a'" if any_word else None, "'b'" if rarest_word else None) == kinds


async def test_the_search_route_fails_closed_without_the_auth_middleware() -> None:
    import httpx
    from fastapi import FastAPI

    from services.runtime.web.http_problem import install_problem_handlers
    from services.search.routes import search_router

    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(search_router)
    app.state.searcher = None  # never reached
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post(
            "/v1/tenants/acme/search",
            json={"query": "refund", "principals": ["group:all"]},
            headers={"Authorization": "Bearer kb.acme.whatever"},
        )
    assert response.status_code == 401
    assert response.json()["errorCode"] == "UNAUTHENTICATED"
