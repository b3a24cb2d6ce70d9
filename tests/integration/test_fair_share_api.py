"""Fair shares through the composed app (services/app.py) over a real PostgreSQL: a tenant
beyond its tier's share is answered 429 with Retry-After while another tenant is served,
and publishing is limited too. Each tenant's tier is read from the tenant table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.publisher.bulk.store_pg import PgBulkStore
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgPublisherStore
from services.publisher.web.api import PublisherStores
from services.runtime.fair_share.settings import FairShareSettings, TierLimits
from services.runtime.fair_share.tiers import PgTenantTiers
from services.runtime.settings import RuntimeSettings
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, Searcher, SearchRequest, SearchResult
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL, ApiTenant, add_tenant, upload
from tests.support.search import ChunkSpec, add_document, add_version, point_search_at

pytestmark = pytest.mark.integration

# The "free" tier: one search in flight, one publish a second (two seconds a token).
FAIR = FairShareSettings(
    search_global_concurrency=2,
    tiers={"free": TierLimits(search_concurrency=1, publish_rate=0.5, publish_burst=1)},
)
QUERY = {"query": "refunds", "principals": ["group:all"], "mode": "keyword"}


class HeldSearches:
    """Search, but a search of ``held_tenant`` waits (in flight, its slot taken) until
    ``release`` is set."""

    def __init__(self, searcher: Searcher, held_tenant: str) -> None:
        self.searcher = searcher
        self.held_tenant = held_tenant
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def search(self, request: SearchRequest) -> SearchResult:
        if request.tenant_id == self.held_tenant:
            self.entered.set()
            await self.release.wait()
        return await self.searcher.search(request)


@pytest.fixture
async def app_pool(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await open_search_pool(
        PublisherSettings(database_url=settings.database_url, db_pool_max_size=6)
    )
    try:
        yield pool
    finally:
        await pool.close()


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL)


def _refusals(kind: str, tier: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "kb_fair_share_refusals_total", {"kind": kind, "tier": tier, "reason": reason}
    )
    return value or 0.0


async def test_a_flooding_tenant_gets_429_while_another_is_served(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any], app_pool: asyncpg.Pool[Any]
) -> None:
    flooder = await add_tenant(conn, "flooder", "free")
    quiet = await add_tenant(conn, "quiet", "standard")
    embedder = HashingEmbedder(32)
    for tenant in (flooder, quiet):
        document_id = await add_document(conn, tenant.tenant_id)
        await add_version(
            conn, tenant.tenant_id, document_id, 1, [ChunkSpec("refunds in 30 days")], embedder
        )
        await point_search_at(conn, tenant.tenant_id, document_id, 1, embedder.model)
    index = PgSearchIndex(
        app_pool, Generation(embedder.model, 32), SearchSettings(database_url=settings.database_url)
    )
    searches = HeldSearches(Searcher(embedder, index), held_tenant="flooder")
    app = create_app(
        PublisherSettings(database_url=settings.database_url),
        stores=PublisherStores(PgPublisherStore(app_pool)),
        searcher=searches,
        fair_share_settings=FAIR,
        tenant_tiers=PgTenantTiers(app_pool),
    )
    refused_before = _refusals("search", "free", "concurrency")
    async with _client(app) as client:
        held = asyncio.create_task(_search(client, flooder))
        await searches.entered.wait()

        refused = await _search(client, flooder)
        served = await _search(client, quiet)

        searches.release.set()
        assert (await held).status_code == 200
    assert refused.status_code == 429, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["errorCode"] == "TENANT_CONCURRENCY_LIMITED"
    assert served.status_code == 200, served.text
    assert len(served.json()["results"]) == 1
    assert _refusals("search", "free", "concurrency") == refused_before + 1
    fair_share = app.state.fair_share
    assert fair_share.shares.tracked() == 0  # nothing in flight any more: nothing kept
    assert fair_share.slots.in_use == 0


async def test_publishing_is_limited_by_the_tenants_rate(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any], app_pool: asyncpg.Pool[Any]
) -> None:
    free = await add_tenant(conn, "free-tenant", "free")
    other = await add_tenant(conn, "other-tenant", "standard")
    app = create_app(
        PublisherSettings(database_url=settings.database_url),
        stores=PublisherStores(PgPublisherStore(app_pool), bulk=PgBulkStore(app_pool)),
        fair_share_settings=FAIR,
        tenant_tiers=PgTenantTiers(app_pool),
    )
    async with _client(app) as client:
        created = await upload(client, free)
        refused = await upload(client, free)
        bulk_refused = await client.post(
            free.path("/documents/bulk"),
            files={"file": ("a.txt", b"text", "text/plain")},
            data={"items": '[{"title": "A", "acl": {"read": ["group:all"]}}]'},
            headers=free.headers,
        )
        others = [await upload(client, other) for _ in range(3)]
    assert created.status_code == 201, created.text
    for answer in (refused, bulk_refused):
        assert answer.status_code == 429, answer.text
        assert answer.json()["errorCode"] == "TENANT_RATE_LIMITED"
        assert int(answer.headers["retry-after"]) in (1, 2)  # a token every two seconds
    assert [r.status_code for r in others] == [201, 201, 201]
    # A refused call wrote nothing.
    assert await conn.fetchval("SELECT count(*) FROM document WHERE tenant_id = 'free-tenant'") == 1


async def _search(client: httpx.AsyncClient, tenant: ApiTenant) -> httpx.Response:
    return await client.post(tenant.path("/search"), json=QUERY, headers=tenant.headers)
