"""Search degrades instead of failing (issue 27): when the query cannot be embedded -- the
provider throttles, is down, answers a page that is no embeddings answer, or is slower than
the searcher's timeout -- hybrid answers from the keyword list alone, flagged, logged and
counted; vector answers 503 with Retry-After; keyword never embeds. Over fakes: a fake
index, fake embedders, and the composed app over a memory store (no server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import httpx
import pytest
import structlog
from prometheus_client import REGISTRY

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Vectors
from services.publisher.settings import PublisherSettings
from services.publisher.web.api import PublisherStores
from services.runtime.errors import KbError
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from services.search.metrics import DEGRADED_REASONS
from services.search.searcher import (
    DEFAULT_RETRY_AFTER_SECONDS,
    Degraded,
    QueryEmbeddingUnavailable,
    Searcher,
    SearchMode,
    SearchRequest,
)
from services.search.statements import SearchSettings
from tests.fakes.publisher_store import MemoryPublisherStore
from tests.fakes.search_index import DIMENSION, FakeIndex

TINY_TIMEOUT = 0.05

PROVIDER_CODES = (
    ErrorCode.EMBEDDING_RATE_LIMITED,
    ErrorCode.EMBEDDING_TIMEOUT,
    ErrorCode.EMBEDDING_UNAVAILABLE,
    ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
)
TERMINAL_CODES = (ErrorCode.EMBEDDING_RESPONSE_INVALID, ErrorCode.EMBEDDING_MODEL_CHANGED)


class FailingEmbedder(HashingEmbedder):
    def __init__(self, code: str, retry_after_seconds: float | None = None) -> None:
        super().__init__(DIMENSION)
        self.code = code
        self.retry_after_seconds = retry_after_seconds
        self.calls = 0

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        raise IndexingFailed(
            self.code, "provider says no", retry_after_seconds=self.retry_after_seconds
        )


class HangingEmbedder(HashingEmbedder):
    """Never answers: waits on an event nobody sets, and records being cancelled."""

    def __init__(self) -> None:
        super().__init__(DIMENSION)
        self.never = asyncio.Event()
        self.cancelled = False

    async def embed(self, texts: Sequence[str]) -> Vectors:
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("the event is never set")


class OwnTimeoutEmbedder(HashingEmbedder):
    """An embedder whose own code raises TimeoutError: a bug, not the searcher's timeout."""

    async def embed(self, texts: Sequence[str]) -> Vectors:
        raise TimeoutError("the embedder's own")


def degraded_count(reason: str) -> float:
    value = REGISTRY.get_sample_value("kb_search_degraded_total", {"reason": reason})
    return value or 0.0


def hybrid(query: str = "refund") -> SearchRequest:
    return SearchRequest("acme", query, ("p",), top_k=5)


# --- the use case ----------------------------------------------------------------------------


async def test_a_healthy_provider_answers_hybrid_undegraded() -> None:
    index = FakeIndex()
    result = await Searcher(HashingEmbedder(DIMENSION), index).search(hybrid())
    assert result.degraded is None
    assert index.requests[0].mode is SearchMode.HYBRID
    assert index.vectors[0] is not None
    assert [h.chunk_id for h in result.results] == ["v", "k1"]


@pytest.mark.parametrize("code", PROVIDER_CODES)
async def test_hybrid_answers_from_the_keyword_list_when_the_provider_fails(code: str) -> None:
    index = FakeIndex()
    searcher = Searcher(FailingEmbedder(code, retry_after_seconds=1.5), index)
    before = degraded_count(code)

    with structlog.testing.capture_logs() as logs:
        result = await searcher.search(hybrid())

    assert result.degraded is Degraded.KEYWORD_ONLY
    # The keyword list alone, ranked as keyword mode ranks it (its scores, every candidate).
    assert index.vectors == [None]
    assert index.requests[0].mode is SearchMode.KEYWORD
    assert index.requests[0].top_k == 5
    assert [(h.chunk_id, h.score) for h in result.results] == [("k1", 3.0), ("k2", 1.0)]
    assert degraded_count(code) == before + 1
    [event] = [e for e in logs if e["event"] == "search.degraded"]
    assert event["reason"] == code
    assert event["error_code"] == code
    assert event["tenant_id"] == "acme"
    assert event["mode"] == "hybrid"
    assert event["retry_after_seconds"] == 1.5


async def test_hybrid_answers_from_the_keyword_list_when_the_embedding_is_too_slow() -> None:
    index = FakeIndex()
    embedder = HangingEmbedder()
    searcher = Searcher(embedder, index, query_embed_timeout_seconds=TINY_TIMEOUT)
    before = degraded_count("timeout")

    with structlog.testing.capture_logs() as logs:
        result = await asyncio.wait_for(searcher.search(hybrid()), timeout=5)

    assert result.degraded is Degraded.KEYWORD_ONLY
    assert [h.chunk_id for h in result.results] == ["k1", "k2"]
    assert index.vectors == [None]
    assert embedder.cancelled  # the embedding was given up, not left running
    assert degraded_count("timeout") == before + 1
    [event] = [e for e in logs if e["event"] == "search.degraded"]
    assert (event["reason"], event["error_code"]) == ("timeout", ErrorCode.EMBEDDING_TIMEOUT)


@pytest.mark.parametrize(
    ("retry_after_seconds", "header"),
    [(None, DEFAULT_RETRY_AFTER_SECONDS), (0.2, 1), (2.0, 2), (2.01, 3), (30.5, 31)],
)
@pytest.mark.parametrize("code", PROVIDER_CODES)
async def test_vector_search_fails_with_the_code_and_when_to_retry(
    code: str, retry_after_seconds: float | None, header: int
) -> None:
    index = FakeIndex()
    searcher = Searcher(FailingEmbedder(code, retry_after_seconds), index)
    before = degraded_count(code)
    with pytest.raises(QueryEmbeddingUnavailable) as raised:
        await searcher.search(SearchRequest("acme", "q", ("p",), mode=SearchMode.VECTOR))
    assert raised.value.code == code
    assert raised.value.http_status == 503
    assert raised.value.retry_after == header
    assert index.requests == []  # nothing read: there is no vector list without a vector
    assert degraded_count(code) == before  # a failure, not a degraded answer


async def test_vector_search_past_the_timeout_fails_with_embedding_timeout() -> None:
    searcher = Searcher(HangingEmbedder(), FakeIndex(), query_embed_timeout_seconds=TINY_TIMEOUT)
    with pytest.raises(QueryEmbeddingUnavailable) as raised:
        await asyncio.wait_for(
            searcher.search(SearchRequest("acme", "q", ("p",), mode=SearchMode.VECTOR)), 5
        )
    assert (raised.value.code, raised.value.reason) == (ErrorCode.EMBEDDING_TIMEOUT, "timeout")
    assert raised.value.retry_after == DEFAULT_RETRY_AFTER_SECONDS


@pytest.mark.parametrize("code", TERMINAL_CODES)
@pytest.mark.parametrize("mode", [SearchMode.HYBRID, SearchMode.VECTOR])
async def test_a_wrong_answer_is_not_degraded_but_a_500_with_its_code(
    code: str, mode: SearchMode
) -> None:
    index = FakeIndex()
    searcher = Searcher(FailingEmbedder(code), index)
    with pytest.raises(KbError) as raised:
        await searcher.search(SearchRequest("acme", "q", ("p",), mode=mode))
    assert raised.value.code == code
    assert not isinstance(raised.value, QueryEmbeddingUnavailable)
    assert raised.value.http_status == 500
    assert index.requests == []


async def test_an_embedders_own_timeout_error_is_not_taken_for_the_searchers() -> None:
    index = FakeIndex()
    searcher = Searcher(OwnTimeoutEmbedder(DIMENSION), index)
    with pytest.raises(TimeoutError, match="the embedder's own"):
        await searcher.search(hybrid())
    assert index.requests == []


async def test_keyword_search_never_embeds() -> None:
    index = FakeIndex()
    embedder = FailingEmbedder(ErrorCode.EMBEDDING_UNAVAILABLE)
    result = await Searcher(embedder, index).search(
        SearchRequest("acme", "q", ("p",), mode=SearchMode.KEYWORD)
    )
    assert embedder.calls == 0
    assert result.degraded is None
    assert [h.chunk_id for h in result.results] == ["k1", "k2"]


def test_the_timeout_setting_defaults_to_two_seconds_and_must_be_positive() -> None:
    assert SearchSettings.model_fields["search_query_embed_timeout_seconds"].default == 2.0
    with pytest.raises(ValueError, match="positive"):
        Searcher(HashingEmbedder(DIMENSION), FakeIndex(), query_embed_timeout_seconds=0)


def test_every_degraded_reason_is_exported_before_it_happens() -> None:
    assert set(DEGRADED_REASONS) == {*PROVIDER_CODES, "timeout"}
    for reason in DEGRADED_REASONS:
        assert REGISTRY.get_sample_value("kb_search_degraded_total", {"reason": reason}) is not None


# --- the HTTP answer ---------------------------------------------------------------------------


@asynccontextmanager
async def served(searcher: Searcher) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    store = MemoryPublisherStore()
    key = new_api_key("acme")
    store.add_tenant("acme", "standard", hash_api_key(key))
    app = create_app(
        PublisherSettings(database_url="postgresql://unused/kb"),
        stores=PublisherStores(store),
        searcher=searcher,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, {"Authorization": f"Bearer {key}"}


async def post_search(
    client: httpx.AsyncClient, headers: dict[str, str], mode: str
) -> httpx.Response:
    return await client.post(
        "/v1/tenants/acme/search",
        json={"query": "refund", "principals": ["p"], "mode": mode},
        headers=headers,
    )


async def test_the_answer_carries_degraded_null_when_healthy() -> None:
    async with served(Searcher(HashingEmbedder(DIMENSION), FakeIndex())) as (client, headers):
        response = await post_search(client, headers, "hybrid")
    assert response.status_code == 200, response.text
    assert response.json()["degraded"] is None
    assert [r["chunkId"] for r in response.json()["results"]] == ["v", "k1"]


@pytest.mark.parametrize("code", PROVIDER_CODES)
async def test_hybrid_answers_200_keyword_only_and_vector_503_with_retry_after(code: str) -> None:
    searcher = Searcher(FailingEmbedder(code, retry_after_seconds=7.2), FakeIndex())
    async with served(searcher) as (client, headers):
        degraded = await post_search(client, headers, "hybrid")
        failed = await post_search(client, headers, "vector")
        keyword = await post_search(client, headers, "keyword")

    assert degraded.status_code == 200, degraded.text
    body = degraded.json()
    assert body["degraded"] == "keyword-only"
    assert [r["chunkId"] for r in body["results"]] == ["k1", "k2"]

    assert failed.status_code == 503, failed.text
    assert failed.headers["content-type"] == "application/problem+json"
    assert failed.headers["retry-after"] == "8"
    problem = failed.json()
    assert (problem["status"], problem["errorCode"]) == (503, code)
    assert "provider says no" not in problem["detail"]  # internal detail stays in the log

    assert keyword.status_code == 200
    assert keyword.json()["degraded"] is None


async def test_vector_past_the_timeout_answers_503_with_the_default_retry_after() -> None:
    searcher = Searcher(HangingEmbedder(), FakeIndex(), query_embed_timeout_seconds=TINY_TIMEOUT)
    async with served(searcher) as (client, headers):
        failed = await asyncio.wait_for(post_search(client, headers, "vector"), 5)
        degraded = await asyncio.wait_for(post_search(client, headers, "hybrid"), 5)
    assert failed.status_code == 503
    assert failed.headers["retry-after"] == str(DEFAULT_RETRY_AFTER_SECONDS)
    assert failed.json()["errorCode"] == ErrorCode.EMBEDDING_TIMEOUT
    assert degraded.status_code == 200
    assert degraded.json()["degraded"] == "keyword-only"


@pytest.mark.parametrize("code", TERMINAL_CODES)
async def test_a_wrong_answer_stays_a_500_in_hybrid(code: str) -> None:
    async with served(Searcher(FailingEmbedder(code), FakeIndex())) as (client, headers):
        response = await post_search(client, headers, "hybrid")
    assert response.status_code == 500
    assert response.json()["errorCode"] == code
    assert "retry-after" not in response.headers


def test_the_schema_documents_the_degraded_field() -> None:
    app = create_app(PublisherSettings(database_url="postgresql://unused/kb"))
    schemas = app.openapi()["components"]["schemas"]
    [name] = [n for n in schemas if n.startswith("SearchResponse")]
    degraded = schemas[name]["properties"]["degraded"]
    assert "keyword-only" in degraded["description"]
    enum_refs = [
        choice["$ref"].rsplit("/", 1)[-1] for choice in degraded["anyOf"] if "$ref" in choice
    ]
    assert [schemas[ref]["enum"] for ref in enum_refs] == [["keyword-only"]]
    assert {"type": "null"} in degraded["anyOf"]
