"""Helpers for publisher API tests: tenants with keys, an in-process app over a real database,
uploads, and a snapshot of every row a request could change."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
from fastapi import FastAPI

from services.publisher.bulk.store_pg import PgBulkStore
from services.publisher.ingest.store_pg import PgIngestStore
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgTenantStore, open_publisher_pool
from services.publisher.web.api import PublisherStores, create_app
from services.runtime.auth.settings import AuthSettings
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key

BASE_URL = "http://publisher.test"
# Failed-key throttling out of the way of tests that send many refused requests.
UNTHROTTLED = AuthSettings(failed_auth_burst=100_000, failed_auth_per_minute=60_000)


@dataclass(frozen=True)
class ApiTenant:
    tenant_id: str
    tier: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def path(self, rest: str = "") -> str:
        return f"/v1/tenants/{self.tenant_id}{rest}"


async def add_tenant(
    conn: asyncpg.Connection[Any], tenant_id: str | None = None, tier: str = "standard"
) -> ApiTenant:
    tenant_id = tenant_id or f"t-{uuid.uuid4().hex[:8]}"
    key = new_api_key(tenant_id)
    await PgTenantStore(conn).create_tenant(tenant_id, tier, hash_api_key(key))
    return ApiTenant(tenant_id, tier, key)


@dataclass
class Harness:
    app: FastAPI
    client: httpx.AsyncClient
    pool: asyncpg.Pool[Any]


@asynccontextmanager
async def publisher_harness(
    settings: RuntimeSettings,
    *,
    max_upload_bytes: int = 64 * 1024,
    pool_size: int = 4,
    auth_settings: AuthSettings = UNTHROTTLED,
    **pool_options: Any,
) -> AsyncIterator[Harness]:
    """The real app over the test's database, called in-process through ASGITransport, on
    the pool the publisher opens (``pool_options``: e.g. an ``init`` that logs). Failed keys
    are not throttled unless ``auth_settings`` says so: a test sends all its refused
    requests from one address (tests/security tests the throttle)."""
    publisher_settings = PublisherSettings(
        database_url=settings.database_url,
        kafka_bootstrap_servers=settings.kafka_bootstrap_servers,
        publisher_max_upload_bytes=max_upload_bytes,
        db_pool_max_size=pool_size,
    )
    pool = await open_publisher_pool(publisher_settings, **pool_options)
    try:
        app = create_app(
            publisher_settings,
            stores=PublisherStores(
                PgIngestStore(pool), bulk=PgBulkStore(pool), erasure=PgErasureStore(pool)
            ),
            auth_settings=auth_settings,
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield Harness(app, client, pool)
    finally:
        await pool.close()


async def upload(
    client: httpx.AsyncClient,
    tenant: ApiTenant,
    content: bytes = b"Refunds are possible within 30 days.",
    *,
    title: str | None = "Refund policy",
    media_type: str = "text/plain",
    filename: str = "refunds.txt",
    document_id: uuid.UUID | str | None = None,
) -> httpx.Response:
    files = {"file": (filename, content, media_type)}
    if document_id is None:
        return await client.post(
            tenant.path("/documents"),
            files=files,
            data={"title": title} if title is not None else {},
            headers=tenant.headers,
        )
    return await client.post(
        tenant.path(f"/documents/{document_id}/versions"), files=files, headers=tenant.headers
    )


async def publish(
    client: httpx.AsyncClient,
    tenant: ApiTenant,
    document_id: uuid.UUID | str,
    version_number: int,
    revision: int,
    read: list[str] | None = None,
) -> httpx.Response:
    return await client.post(
        tenant.path(f"/documents/{document_id}/versions/{version_number}/publish"),
        json={"revision": revision, "acl": {"read": read if read is not None else ["group:all"]}},
        headers=tenant.headers,
    )


_SNAPSHOT_QUERIES = {
    "tenant": "SELECT tenant_id, tier FROM tenant",
    "tenant_api_key": "SELECT key_id, tenant_id, revoked_at FROM tenant_api_key",
    "document": (
        "SELECT tenant_id, document_id, title, revision, latest_version, published_version,"
        " published_at, deleted_at FROM document"
    ),
    "document_version": (
        "SELECT tenant_id, document_id, version_number, sha256, status, published_at"
        " FROM document_version"
    ),
    "document_acl": "SELECT tenant_id, document_id, principal, permission FROM document_acl",
    "document_version_acl": (
        "SELECT tenant_id, document_id, version_number, principal, permission"
        " FROM document_version_acl"
    ),
    "index_task": "SELECT task_id, status, next_attempt_at FROM index_task",
    "outbox": "SELECT position, event_id, event_type FROM outbox",
}


async def snapshot(conn: asyncpg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row (its identifying and mutable columns) a publisher request could touch."""
    state: dict[str, list[tuple[Any, ...]]] = {}
    for table, query in _SNAPSHOT_QUERIES.items():
        rows = await conn.fetch(query)
        state[table] = sorted((tuple(row.values()) for row in rows), key=repr)
    return state


async def row_counts(conn: asyncpg.Connection[Any]) -> dict[str, int]:
    return {table: len(rows) for table, rows in (await snapshot(conn)).items()}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def live_publisher(settings: PublisherSettings) -> Iterator[str]:
    """The real app served by uvicorn on a free port, in a thread with its own event loop
    (the app opens its own pool in its lifespan, on that loop); yields the base URL."""
    with live_app(create_app(settings), settings) as url:
        yield url


@contextmanager
def live_app(app: FastAPI, settings: PublisherSettings) -> Iterator[str]:
    """``app`` (the publisher's, or the composed one of services/app.py) served like
    ``live_publisher`` serves the publisher's, with ``kb serve``'s uvicorn options."""
    import threading

    import uvicorn

    port = free_port()
    from services.publisher.web.server import uvicorn_options

    options = {**uvicorn_options(settings), "log_level": "warning"}
    config = uvicorn.Config(app, host="127.0.0.1", port=port, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="publisher-under-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the publisher did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def app_with_key(store: Any, auth_settings: AuthSettings) -> tuple[FastAPI, str]:
    """The publisher's app on ``store`` (an in-memory one) with auth ``auth_settings``, and a
    good API key of its tenant ``acme``."""
    key = new_api_key("acme")
    store.add_tenant("acme", "standard", hash_api_key(key))
    return create_app(
        PublisherSettings(), stores=PublisherStores(store), auth_settings=auth_settings
    ), key
