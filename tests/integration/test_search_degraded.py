"""Search degrades instead of failing (issue 27), end to end: the composed app as `kb serve`
builds it (its lifespan opens the search pool and the query embedder from the embedding
settings) over real PostgreSQL, embedding queries with the fault-injecting OpenAI-compatible
test provider over real HTTP. The provider goes down, then hangs, then recovers: hybrid
search answers all along (keyword-only while the query cannot be embedded), vector search
answers 503 with Retry-After, and the flag is gone once the provider is back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import pytest
import structlog
from prometheus_client import REGISTRY

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.publisher.settings import PublisherSettings
from services.runtime.indexing.index_failures import ErrorCode
from services.runtime.settings import RuntimeSettings
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL, add_tenant
from tests.support.embedding_provider import EmbeddingProvider, served_provider
from tests.support.search import (
    ChunkSpec,
    add_document,
    add_version,
    create_ann_index,
    point_search_at,
)

pytestmark = pytest.mark.integration

MODEL = "test-embed"
DIMENSION = 64
# Short, so that the hanging provider costs the test little; long enough for a healthy
# round trip to the provider on a busy machine.
QUERY_EMBED_TIMEOUT = 1.0


class ProviderVectors(HashingEmbedder):
    """The test provider's vectors (it embeds with the hashing embedder) under the model name
    the app's provider settings give: the chunks the app's query embedder can search."""

    @property
    def model(self) -> str:
        return MODEL


def degraded_count(reason: str) -> float:
    return REGISTRY.get_sample_value("kb_search_degraded_total", {"reason": reason}) or 0.0


async def test_hybrid_search_answers_keyword_only_while_the_provider_is_down_and_recovers(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    acme = await add_tenant(conn, "acme")
    vectors = ProviderVectors(DIMENSION)
    refunds = await add_document(conn, "acme", title="Refund policy", read=("group:all",))
    await add_version(
        conn, "acme", refunds, 1, [ChunkSpec("refunds are paid within 30 days")], vectors
    )
    await point_search_at(conn, "acme", refunds, 1, MODEL)
    shipping = await add_document(conn, "acme", title="Shipping", read=("group:all",))
    await add_version(
        conn, "acme", shipping, 1, [ChunkSpec("parcels ship in five working days")], vectors
    )
    await point_search_at(conn, "acme", shipping, 1, MODEL)

    url, kafka = settings.database_url, settings.kafka_bootstrap_servers
    with served_provider(EmbeddingProvider(dimension=DIMENSION)) as provider:
        app = create_app(
            PublisherSettings(database_url=url, kafka_bootstrap_servers=kafka),
            search_settings=SearchSettings(
                database_url=url,
                kafka_bootstrap_servers=kafka,
                search_query_embed_timeout_seconds=QUERY_EMBED_TIMEOUT,
            ),
            embedding_settings=EmbeddingSettings(
                provider=OpenAIConfig(base_url=provider.base_url, model=MODEL, dimensions=DIMENSION)
            ),
        )
        async with app.router.lifespan_context(app):
            pool = await asyncpg.create_pool(url, min_size=1, max_size=1)
            try:
                await create_ann_index(pool, MODEL, DIMENSION)
            finally:
                await pool.close()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:

                async def search(mode: str) -> httpx.Response:
                    # Bounded: a search that waits on the hanging provider fails the test.
                    return await asyncio.wait_for(
                        client.post(
                            acme.path("/search"),
                            json={"query": "refunds", "principals": ["group:all"], "mode": mode},
                            headers=acme.headers,
                        ),
                        timeout=20,
                    )

                await _healthy(search, refunds)
                requests_before = len(provider.control.requests())

                # The provider is down: 503 with a Retry-After of 12 s, until cleared.
                provider.control.inject("status", status=503, retry_after="12")
                unavailable_before = degraded_count(ErrorCode.EMBEDDING_UNAVAILABLE)
                with structlog.testing.capture_logs() as logs:
                    degraded = await search("hybrid")
                assert degraded.status_code == 200, degraded.text
                body = degraded.json()
                assert body["degraded"] == "keyword-only"
                # The keyword list's hit: the refunds chunk only (shipping shares no word).
                assert [r["documentId"] for r in body["results"]] == [str(refunds)]
                assert body["generation"] == {
                    "embeddingModel": MODEL,
                    "dimension": DIMENSION,
                    # The default generation, should the indexer side have registered one.
                    "generationId": await conn.fetchval(
                        "SELECT generation_id FROM search_generation WHERE is_default"
                    ),
                }
                assert degraded_count(ErrorCode.EMBEDDING_UNAVAILABLE) == unavailable_before + 1
                [event] = [e for e in logs if e["event"] == "search.degraded"]
                assert (event["reason"], event["tenant_id"]) == (
                    ErrorCode.EMBEDDING_UNAVAILABLE,
                    "acme",
                )
                scraped = await client.get("/metrics")
                assert 'kb_search_degraded_total{reason="EMBEDDING_UNAVAILABLE"}' in scraped.text

                failed = await search("vector")
                assert failed.status_code == 503, failed.text
                assert failed.headers["content-type"] == "application/problem+json"
                assert failed.headers["retry-after"] == "12"  # the provider's own
                assert failed.json()["errorCode"] == ErrorCode.EMBEDDING_UNAVAILABLE

                keyword = await search("keyword")
                assert keyword.status_code == 200
                assert keyword.json()["degraded"] is None
                # Both embedding searches asked the provider, and it refused them; keyword
                # mode never asked.
                refused = provider.control.requests()[requests_before:]
                assert [r.fault for r in refused] == ["status", "status"]

                # The provider hangs: the searcher's own timeout gives the query up.
                provider.control.clear_faults()
                provider.control.inject("hang", hang_seconds=60)
                timeout_before = degraded_count("timeout")
                slow = await search("hybrid")
                assert slow.status_code == 200, slow.text
                assert slow.json()["degraded"] == "keyword-only"
                assert [r["documentId"] for r in slow.json()["results"]] == [str(refunds)]
                assert degraded_count("timeout") == timeout_before + 1
                slow_vector = await search("vector")
                assert slow_vector.status_code == 503
                assert slow_vector.headers["retry-after"] == "5"  # no time named: the default
                assert slow_vector.json()["errorCode"] == ErrorCode.EMBEDDING_TIMEOUT

                # The provider recovers: the flag is gone, vector answers again.
                provider.control.clear_faults()
                await _healthy(search, refunds)
    assert app.state.searcher is None


async def _healthy(search: Callable[[str], Awaitable[httpx.Response]], refunds: uuid.UUID) -> None:
    hybrid = await search("hybrid")
    assert hybrid.status_code == 200, hybrid.text
    assert hybrid.json()["degraded"] is None
    assert str(refunds) in [r["documentId"] for r in hybrid.json()["results"]]
    vector = await search("vector")
    assert vector.status_code == 200, vector.text
    assert vector.json()["degraded"] is None
    assert vector.json()["results"], "the vector list finds the chunks"
