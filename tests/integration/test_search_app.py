"""The composed app as `kb serve` builds it: its lifespan opens the search side (pool and the
query embedder from KB_EMBEDDING_*) next to the publisher's, and both routes are served."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx
import pytest

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.settings import EmbeddingSettings, HashingConfig
from services.publisher.settings import PublisherSettings
from services.runtime.settings import RuntimeSettings
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL, add_tenant, upload
from tests.support.search import (
    ChunkSpec,
    add_document,
    add_version,
    create_ann_index,
    point_search_at,
)

pytestmark = pytest.mark.integration


async def test_the_served_app_publishes_and_searches(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    acme = await add_tenant(conn, "acme")
    embedder = HashingEmbedder(32)
    document_id = await add_document(conn, "acme", read=("group:all",))
    await add_version(conn, "acme", document_id, 1, [ChunkSpec("refunds in 30 days")], embedder)
    await point_search_at(conn, "acme", document_id, 1, embedder.model)
    url, kafka = settings.database_url, settings.kafka_bootstrap_servers
    app = create_app(
        PublisherSettings(database_url=url, kafka_bootstrap_servers=kafka),
        search_settings=SearchSettings(database_url=url, kafka_bootstrap_servers=kafka),
        embedding_settings=EmbeddingSettings(provider=HashingConfig(kind="hashing", dimensions=32)),
    )
    async with app.router.lifespan_context(app):
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=1)
        try:
            await create_ann_index(pool, embedder.model, embedder.dimension)
        finally:
            await pool.close()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            assert (await upload(client, acme)).status_code == 201
            response = await client.post(
                acme.path("/search"),
                json={"query": "refunds", "principals": ["group:all"]},
                headers=acme.headers,
            )
            assert response.status_code == 200, response.text
            body = response.json()
            assert [r["documentId"] for r in body["results"]] == [str(document_id)]
            assert body["generation"] == {
                "embeddingModel": "hashing-v1-32",
                "dimension": 32,
                # The default generation, should the indexer side have registered one.
                "generationId": await conn.fetchval(
                    "SELECT generation_id FROM search_generation WHERE is_default"
                ),
            }
            unauthenticated = await client.post(
                acme.path("/search"), json={"query": "refunds", "principals": ["group:all"]}
            )
            assert unauthenticated.status_code == 401
            assert "/v1/tenants/{tenantId}/search" in app.openapi()["paths"]
    assert app.state.searcher is None
