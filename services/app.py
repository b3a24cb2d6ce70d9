"""The HTTP app ``kb serve`` runs, composed: the publisher's API, the search route and the
operator page.

Composition lives here, above the services, so that no service imports another: the search
router is mounted into the app the publisher builds, inside its tenant-auth middleware (the
operator page at /ui has its own sign-in and is not under /v1), and the resources of search
and the operator page (one pool, the query embedders) open in the app's lifespan.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.middleware import Middleware

from services.embedding.settings import EmbeddingSettings, load_embedding_settings
from services.operator.context import OperatorContext, build_operator_context
from services.operator.routes import mount_operator
from services.operator.settings import OperatorSettings
from services.publisher.ports import StatusReplicas
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgPublisherStore
from services.publisher.web.api import PublisherStores
from services.publisher.web.api import create_app as create_publisher_app
from services.publisher.web.body_limit import BodyLimitMiddleware
from services.runtime.auth.settings import AuthSettings
from services.runtime.fair_share.gate import FairShare
from services.runtime.fair_share.middleware import FairShareMiddleware, limited_routes
from services.runtime.fair_share.settings import FairShareSettings, Kind
from services.runtime.fair_share.tiers import PgTenantTiers, TenantTiers
from services.runtime.indexing.search_lag import run_search_lag_sampler
from services.runtime.logging import get_logger
from services.runtime.tracing.http import trace_http_app
from services.runtime.web.http_strict import StrictHeadersMiddleware, StrictJsonMiddleware
from services.search.routes import search_router
from services.search.searcher import SearchService
from services.search.statements import SearchSettings

log = get_logger(__name__)

# The routes that take their tenant's fair share (docs/architecture.md#fair-shares), all POST.
FAIR_SHARE_ROUTES = {
    "/v1/tenants/{tenantId}/search": Kind.SEARCH,
    "/v1/tenants/{tenantId}/documents": Kind.PUBLISH,
    "/v1/tenants/{tenantId}/documents/bulk": Kind.PUBLISH,
    "/v1/tenants/{tenantId}/documents/{documentId}/versions": Kind.PUBLISH,
    "/v1/tenants/{tenantId}/documents/{documentId}/versions/{versionNumber}/publish": Kind.PUBLISH,
}


def create_app(
    settings: PublisherSettings | None = None,
    *,
    stores: PublisherStores | None = None,
    searcher: SearchService | None = None,
    search_settings: SearchSettings | None = None,
    embedding_settings: EmbeddingSettings | None = None,
    operator: OperatorContext | None = None,
    operator_settings: OperatorSettings | None = None,
    auth_settings: AuthSettings | None = None,
    fair_share_settings: FairShareSettings | None = None,
    tenant_tiers: TenantTiers | None = None,
) -> FastAPI:
    """Without ``stores`` / ``searcher`` the app opens its own pools and embedders in its
    lifespan: each tenant is searched in its serving generation (services/search/serving.py),
    with the embedder of ``embedding_settings`` (default: ``KB_EMBEDDING_*``, as the
    indexer's) while the database has no generation and for the default one. Tenants' tiers
    (for their fair share) are read through ``tenant_tiers``, else on the search pool the
    lifespan opens; without either every tenant has the flat ``KB_FAIR_*`` limits."""
    app = create_publisher_app(settings, stores=stores, auth_settings=auth_settings)
    app.title = "kb-pipeline"
    app.state.searcher = searcher
    app.include_router(search_router)
    mount_operator(app, operator)
    _add_strict_http(app)
    _add_fair_share(app, fair_share_settings or _fair_share_settings(), tenant_tiers)
    publisher_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with publisher_lifespan(app):
            if app.state.searcher is not None:
                yield
                return
            async with _search_resources(
                search_settings or SearchSettings(),
                embedding_settings or load_embedding_settings(),
            ) as (built, pool, rotation):
                app.state.searcher = built
                _read_status_on(app, rotation)
                if tenant_tiers is None and app.state.fair_share is not None:
                    app.state.fair_share.use_tiers(PgTenantTiers(pool))
                app.state.search_replicas = getattr(built, "replica_views", None)
                own_operator = getattr(app.state, "operator", None) is None
                if own_operator:
                    app.state.operator = build_operator_context(
                        pool, operator_settings or _operator_settings()
                    )
                stop = asyncio.Event()
                lag = asyncio.create_task(run_search_lag_sampler(pool, stop))
                try:
                    yield
                finally:
                    stop.set()
                    await lag
                    _read_status_on(app, None)
                    # Entered again (kb serve's start, retried), the lifespan opens anew.
                    app.state.searcher = None
                    if own_operator:
                        app.state.operator = None

    app.router.lifespan_context = lifespan
    trace_http_app(app)
    return app


def _read_status_on(app: FastAPI, replicas: StatusReplicas | None) -> None:
    """Documents' status read on search's replicas (docs/scaling.md#status-on-replicas),
    when the publisher's store is the PostgreSQL one the app opened."""
    store = app.state.store
    if isinstance(store, PgPublisherStore):
        store.read_status_on(replicas)


def _add_strict_http(app: FastAPI) -> None:
    """HTTP strictness (services/runtime/web/http_strict.py): the header checks outermost,
    before auth or anything reads the body; the duplicate-JSON-key check just inside the
    body-size limit, so that it buffers only bodies the limit lets through."""
    stack = app.user_middleware  # outermost first
    limit = next(i for i, m in enumerate(stack) if m.cls is BodyLimitMiddleware)  # type: ignore[comparison-overlap]
    stack.insert(limit + 1, Middleware(StrictJsonMiddleware))
    app.add_middleware(StrictHeadersMiddleware)


def _add_fair_share(
    app: FastAPI, settings: FairShareSettings, tenant_tiers: TenantTiers | None
) -> None:
    """Each tenant's share of searches and publishes (services/runtime/fair_share): inside
    tenant authentication, so the tenant is known, and inside the body-size limit, so a
    refused body is dropped within it; before the body is parsed or any work starts."""
    app.state.fair_share = None
    if not settings.enabled:
        return
    routes = limited_routes(FAIR_SHARE_ROUTES)
    fair_share = app.state.fair_share = FairShare(settings, tenant_tiers)
    stack = app.user_middleware  # outermost first
    limit = next(i for i, m in enumerate(stack) if m.cls is BodyLimitMiddleware)  # type: ignore[comparison-overlap]
    stack.insert(limit + 1, Middleware(FairShareMiddleware, fair_share=fair_share, routes=routes))


@asynccontextmanager
async def _search_resources(
    settings: SearchSettings, embedding_settings: EmbeddingSettings
) -> AsyncIterator[tuple[SearchService, Any, Any]]:
    from services.embedding.factory import build_embedder
    from services.embedding.guard.factory import guarded
    from services.embedding.guard.quota import Purpose
    from services.runtime.identity import owner_id
    from services.search.connections import open_search_pool
    from services.search.replicas import replica_rotation
    from services.search.serving import GenerationSearch, query_embedders

    # The same provider settings as the indexer's (KB_EMBEDDING_*): the default generation's
    # queries must be embedded by the model it was built with. Other generations' embedders
    # are opened the first time one of their tenants searches.
    embedder = build_embedder(embedding_settings)
    try:
        pool = await open_search_pool(settings)
        try:
            owner = owner_id()
            # Queries share the provider's limiter (their reserved share) and breaker with
            # the indexers: an open breaker answers at once, and search degrades to keywords.
            query_embedder, _ = guarded(
                embedding_settings, embedder, pool, purpose=Purpose.QUERY, owner=owner
            )
            # Read replicas (KB_SEARCH_DATABASE_URLS): searches only; the embedder's guard
            # writes, and stays on the primary's pool.
            async with replica_rotation(settings, pool) as rotation:
                search = GenerationSearch(
                    pool, settings, query_embedder, query_embedders(pool, owner), rotation=rotation
                )
                log.info(
                    "search.started",
                    embedding_model=embedder.model,
                    dimension=embedder.dimension,
                    replicas=len(rotation.replicas) if rotation else 0,
                )
                try:
                    yield search, pool, rotation
                finally:
                    await search.aclose()
        finally:
            await pool.close()
    finally:
        await embedder.aclose()


def _fair_share_settings() -> FairShareSettings:
    from services.runtime.commands.cli_support import load_settings

    return load_settings(FairShareSettings)


def _operator_settings() -> OperatorSettings:
    from services.runtime.commands.cli_support import load_settings

    return load_settings(OperatorSettings)
