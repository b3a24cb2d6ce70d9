"""The publisher's HTTP app (docs/architecture.md#the-http-contract): its routes, middlewares and
state, composed.

Middlewares, outermost first: metrics (every answer counted), tenant authentication (before
anything reads the body), body limits (size, stall), the upload budget (503 before an
upload's body is read). Every error is ``application/problem+json`` with a stable
``errorCode``. The search call is the search service's (services/search).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from services.publisher.bulk.domain import BulkPublisher, BulkStore
from services.publisher.domain import Publisher
from services.publisher.metrics import PublisherMetrics
from services.publisher.ports import ErasureStore, PublisherStore
from services.publisher.settings import PublisherSettings
from services.publisher.web.body_limit import BodyLimitMiddleware
from services.publisher.web.bulk_routes import bulk_router
from services.publisher.web.ingest_key_routes import ingest_key_router
from services.publisher.web.ops_routes import ops_router
from services.publisher.web.readiness import ReadinessProbe
from services.publisher.web.request_metrics import MetricsMiddleware
from services.publisher.web.routes import bearer, tenant_router
from services.publisher.web.upload_budget import UploadBudget, UploadBudgetMiddleware
from services.runtime.auth.settings import AuthSettings
from services.runtime.logging import get_logger
from services.runtime.tenancy.tenant_auth import TenantAuthMiddleware
from services.runtime.tenancy.tenant_wall import walls_the_publisher
from services.runtime.web.http_problem import (
    document_errors_as_problem_json,
    install_problem_handlers,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class PublisherStores:
    """What the publisher writes through, given together: its ``store``, with the ``bulk``
    store (without one, bulk publishing answers 503) and the ``erasure`` store (without one,
    an erase answers 500 ERASE_UNAVAILABLE)."""

    store: PublisherStore
    bulk: BulkStore | None = None
    erasure: ErasureStore | None = None


def create_app(
    settings: PublisherSettings | None = None,
    *,
    stores: PublisherStores | None = None,
    auth_settings: AuthSettings | None = None,
) -> FastAPI:
    """The publisher app. Without ``stores`` it opens its own pool in its lifespan.
    ``auth_settings``: principal tokens and failed-key throttling (default ``KB_AUTH_*``)."""
    settings = settings or PublisherSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if app.state.store is not None:
            yield
            return
        from services.publisher.bulk.store_pg import PgBulkStore
        from services.publisher.ingest.store_pg import PgIngestStore
        from services.publisher.store_pg import open_publisher_pool
        from services.runtime.erasure.erase_pg import PgErasureStore

        pool = await open_publisher_pool(settings)
        _use_stores(
            app,
            PublisherStores(
                # The publisher's store, with the ingest keys an admin key manages.
                PgIngestStore(
                    pool,
                    acquire_timeout_seconds=settings.publisher_db_acquire_timeout_seconds,
                    readiness_timeout_seconds=settings.publisher_readiness_timeout_seconds,
                    row_security=walls_the_publisher(settings.db_row_security),
                ),
                bulk=PgBulkStore(
                    pool,
                    acquire_timeout_seconds=settings.publisher_db_acquire_timeout_seconds,
                    row_security=walls_the_publisher(settings.db_row_security),
                ),
                erasure=PgErasureStore(pool),
            ),
        )
        log.info("publisher.started")
        try:
            yield
        finally:
            # A lifespan entered again (kb serve's start, retried) opens a store anew.
            app.state.store = app.state.publisher = app.state.bulk_publisher = None
            await pool.close()
            log.info("publisher.stopped")

    app = FastAPI(
        title="kb-pipeline publisher",
        version="1",
        description=(
            "Upload immutable document versions, publish them with a read ACL (indexing "
            "happens later, in the indexer), and see where each document stands. Errors are "
            "application/problem+json with a stable errorCode."
        ),
        lifespan=lifespan,
        generate_unique_id_function=lambda route: route.name,
    )
    document_errors_as_problem_json(app)
    app.state.settings = settings
    app.state.store = None
    app.state.publisher = None
    app.state.bulk_publisher = None
    if stores is not None:
        _use_stores(app, stores)
    app.state.metrics = PublisherMetrics()
    app.state.upload_budget = UploadBudget(settings.publisher_max_inflight_upload_bytes)
    app.state.readiness = ReadinessProbe(
        lambda: _store(app).readiness_problems(),
        cache_seconds=settings.publisher_readiness_cache_seconds,
    )
    install_problem_handlers(app)
    app.include_router(tenant_router)
    app.include_router(bulk_router(bearer))
    app.include_router(ingest_key_router(bearer))
    app.include_router(ops_router)
    # Added innermost first.
    app.add_middleware(
        UploadBudgetMiddleware,
        budget=app.state.upload_budget,
        max_request_bytes=settings.max_request_bytes,
        retry_after_seconds=settings.publisher_retry_after_seconds,
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_upload_bytes=settings.max_request_bytes,
        max_other_bytes=settings.publisher_max_json_body_bytes,
        read_timeout_seconds=settings.publisher_body_read_timeout_seconds,
    )
    app.add_middleware(
        TenantAuthMiddleware,
        key_checker=lambda: _store(app),
        settings=auth_settings or AuthSettings(),
    )
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app


def _use_stores(app: FastAPI, stores: PublisherStores) -> None:
    settings: PublisherSettings = app.state.settings
    app.state.store = stores.store
    app.state.publisher = Publisher(
        stores.store,
        max_upload_bytes=settings.publisher_max_upload_bytes,
        erasure=stores.erasure,
        erase_batch_rows=settings.publisher_erase_batch_rows,
    )
    if stores.bulk is not None:
        app.state.bulk_publisher = BulkPublisher(
            app.state.publisher,
            stores.bulk,
            max_upload_bytes=settings.publisher_max_upload_bytes,
        )


def _store(app: FastAPI) -> PublisherStore:
    store: PublisherStore | None = app.state.store
    if store is None:
        raise RuntimeError("the publisher's store is opened in the app's lifespan")
    return store
