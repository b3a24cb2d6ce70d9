"""kb-client's errors and retries against the real server (issue 45): each problem+json
answer is raised typed, with its stable code, status and Retry-After; 429 and 503 are retried
after Retry-After (with jitter) within the call's deadline, and raised at once when the
server's Retry-After is past it; a stale revision, a revoked key and a refused upload are
never retried; a dead server is retried on safe calls only."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import asyncpg
import httpx
import pytest
from kb_client import (
    AsyncKbClient,
    KbClient,
    RateLimited,
    RetryPolicy,
    RevisionConflict,
    SearchMode,
    ServiceUnavailable,
    TransportError,
    Unauthenticated,
)
from kb_client.models import Degraded

from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.publisher.keys.store_pg import PgKeyStore
from services.runtime.fair_share.settings import FairShareSettings
from tests.client.conftest import serving
from tests.support.api import ApiTenant, free_port

pytestmark = pytest.mark.integration

READ = ["group:all"]
QUERY = "refund"


class Counting(httpx.AsyncHTTPTransport):
    """The real transport, counting the requests sent (retries included)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.url.path)
        return await super().handle_async_request(request)


class CountingSync(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.url.path)
        return super().handle_request(request)


# --- 409: a stale revision --------------------------------------------------------------------


async def test_a_stale_revision_is_a_typed_conflict_never_retried(
    server: str, tenant: ApiTenant
) -> None:
    transport = Counting()
    async with AsyncKbClient(server, tenant.key, transport=transport) as kb:
        created = await kb.create_document(b"v1 text", title="Policy")
        first = await kb.publish(created.document_id, 1, revision=created.revision, read=READ)
        # The same publish again (as a retry after a lost answer would send it) changes
        # nothing and answers the same task: why the client may retry a publish.
        again = await kb.publish(created.document_id, 1, revision=created.revision, read=READ)
        assert again.index_task_id == first.index_task_id
        assert again.revision == first.revision
        v2 = await kb.add_version(created.document_id, b"v2 text")
        sent = len(transport.sent)
        with pytest.raises(RevisionConflict) as caught:
            await kb.publish(created.document_id, 2, revision=first.revision - 1, read=READ)
    error = caught.value
    assert (error.status, error.code) == (409, "REVISION_CONFLICT")
    assert error.current_revision == v2.revision
    assert error.retry_after is None
    assert len(transport.sent) == sent + 1


# --- 401: a revoked key -----------------------------------------------------------------------


async def test_a_revoked_key_is_unauthenticated_and_not_retried(
    server: str, module_database: str, tenant: ApiTenant
) -> None:
    transport = Counting()
    async with AsyncKbClient(server, tenant.key, transport=transport) as kb:
        assert (await kb.search(QUERY, principals=READ)).results == []
        conn = await asyncpg.connect(module_database)
        try:
            [key_id] = await conn.fetchval(
                "SELECT array_agg(key_id) FROM tenant_api_key WHERE tenant_id = $1",
                tenant.tenant_id,
            )
            assert await PgKeyStore(conn).revoke_key(tenant.tenant_id, key_id)
        finally:
            await conn.close()
        with pytest.raises(Unauthenticated) as caught:
            await kb.search(QUERY, principals=READ)
    assert caught.value.status == 401
    assert caught.value.code
    assert len(transport.sent) == 2


# --- 429: the tenant's fair share -------------------------------------------------------------


@pytest.fixture(scope="module")
def throttled_server(module_database: str) -> Iterator[str]:
    """One search a second per tenant, no burst: a second search at once is answered 429
    with Retry-After."""
    fair = FairShareSettings(search_rate=1.0, search_burst=1)
    with serving(module_database, fair_share_settings=fair) as url:
        yield url


async def test_a_429_is_raised_with_its_retry_after_when_not_retried(
    throttled_server: str, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(throttled_server, tenant.key, retry=RetryPolicy(max_attempts=1)) as kb:
        await kb.search(QUERY, principals=READ)
        with pytest.raises(RateLimited) as caught:
            await kb.search(QUERY, principals=READ)
    error = caught.value
    assert error.status == 429
    assert error.code
    assert error.retry_after is not None
    assert error.retry_after >= 1


async def test_a_429_is_retried_after_its_retry_after(
    throttled_server: str, tenant: ApiTenant
) -> None:
    transport = Counting()
    async with AsyncKbClient(throttled_server, tenant.key, transport=transport) as kb:
        await kb.search(QUERY, principals=READ)
        answer = await kb.search(QUERY, principals=READ)
    assert answer.results == []
    # The second search was refused once, then answered after the Retry-After.
    assert len(transport.sent) == 3


async def test_a_retry_after_past_the_deadline_is_raised_at_once(
    throttled_server: str, tenant: ApiTenant
) -> None:
    transport = Counting()
    policy = RetryPolicy(deadline_seconds=0.5)
    async with AsyncKbClient(throttled_server, tenant.key, transport=transport, retry=policy) as kb:
        await kb.search(QUERY, principals=READ)
        with pytest.raises(RateLimited):
            await kb.search(QUERY, principals=READ)
    assert len(transport.sent) == 2


# --- 503: search degraded ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def provider_down_server(module_database: str) -> Iterator[str]:
    """Queries embedded by an OpenAI-compatible provider nobody listens for: vector search
    answers 503 with Retry-After, hybrid answers from keywords alone."""
    down = OpenAIConfig(
        kind="openai",
        base_url=f"http://127.0.0.1:{free_port()}/v1",
        model="down-model",
        dimensions=64,
        connect_timeout_seconds=1,
        timeout_seconds=2,
    )
    with serving(module_database, embedding_settings=EmbeddingSettings(provider=down)) as url:
        yield url


async def test_a_503_from_a_degraded_search_is_retried_then_raised(
    provider_down_server: str, tenant: ApiTenant
) -> None:
    transport = Counting()
    policy = RetryPolicy(max_attempts=2, deadline_seconds=60)
    async with AsyncKbClient(
        provider_down_server, tenant.key, transport=transport, retry=policy
    ) as kb:
        with pytest.raises(ServiceUnavailable) as caught:
            await kb.search(QUERY, principals=READ, mode=SearchMode.VECTOR)
        assert len(transport.sent) == 2
        hybrid = await kb.search(QUERY, principals=READ)
    error = caught.value
    assert error.status == 503
    assert error.code.startswith("EMBEDDING_")
    assert error.retry_after is not None
    assert error.retry_after > 0
    assert hybrid.degraded is Degraded.KEYWORD_ONLY


# --- no server at all ---------------------------------------------------------------------------


def test_a_dead_server_is_retried_on_safe_calls_only() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    key = f"kb.acme.{uuid.uuid4().hex}"
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, deadline_seconds=10)
    transport = CountingSync()
    with KbClient(url, key, retry=policy, transport=transport) as kb:
        with pytest.raises(TransportError) as searched:
            kb.search(QUERY, principals=READ)
        assert len(transport.sent) == 3
        with pytest.raises(TransportError):
            kb.create_document(b"text", title="t")
        assert len(transport.sent) == 4
    assert key not in str(searched.value)
    assert searched.value.__cause__ is None
