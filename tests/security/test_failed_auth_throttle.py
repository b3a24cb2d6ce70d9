"""Failed keys are throttled per client address (issue 29, item 4): after a burst of 401s an
address gets 429 with Retry-After, without its key being looked at, while other addresses
go on; IPv6 addresses count per /64; memory stays bounded. No server needed: the publisher
app over the in-memory store."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from services.app import create_app as create_composed_app
from services.embedding.hashing import HashingEmbedder
from services.publisher.settings import PublisherSettings
from services.publisher.web.api import PublisherStores
from services.runtime.auth.keys import ApiKeyGrant
from services.runtime.auth.settings import AuthSettings
from services.runtime.auth.throttle import FailedAuthThrottle, client_address
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from services.search.searcher import Searcher
from tests.fakes.publisher_store import MemoryPublisherStore
from tests.fakes.search_index import DIMENSION, FakeIndex
from tests.support.api import app_with_key
from tests.support.clock import SecondsClock

BURST = 3
PER_MINUTE = 6.0  # one more try every 10 s


def test_a_bucket_empties_refills_and_is_forgotten_when_full() -> None:
    clock = SecondsClock(1000.0)
    throttle = FailedAuthThrottle(burst=BURST, per_minute=PER_MINUTE, max_addresses=10, clock=clock)
    emptied = []
    for _ in range(BURST):
        assert throttle.retry_after("10.0.0.1") is None
        emptied.append(throttle.record_failure("10.0.0.1"))
    assert emptied == [False, False, True]  # only the failure that empties it says so
    wait = throttle.retry_after("10.0.0.1")
    assert wait == pytest.approx(10.0)
    assert throttle.retry_after("10.0.0.2") is None
    clock.now += 10.0
    assert throttle.retry_after("10.0.0.1") is None  # one try earned back
    throttle.record_failure("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == pytest.approx(10.0)
    clock.now += 3600
    assert throttle.retry_after("10.0.0.1") is None
    assert len(throttle) == 0


def test_memory_is_bounded_by_the_addresses_tracked() -> None:
    clock = SecondsClock(1000.0)
    throttle = FailedAuthThrottle(burst=1, per_minute=1.0, max_addresses=100, clock=clock)
    for i in range(10_000):
        throttle.record_failure(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(throttle) == 100
    assert throttle.retry_after("10.0.39.15") is not None  # the most recent are kept


@pytest.mark.parametrize(
    ("client", "counted_as"),
    [
        (("192.0.2.7", 1), "192.0.2.7"),
        (("2001:db8:1:2:aaaa::1", 1), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 1), "2001:db8:1:2::/64"),
        (("::ffff:192.0.2.7", 1), "192.0.2.7"),
        (None, "unknown"),
    ],
)
def test_addresses_are_counted_per_host(client: Any, counted_as: str) -> None:
    assert client_address({"type": "http", "client": client}) == counted_as


class CountingStore(MemoryPublisherStore):
    def __init__(self) -> None:
        super().__init__()
        self.key_checks = 0

    async def api_key(
        self, tenant_id: str, key_hash: bytes, now: datetime | None = None
    ) -> ApiKeyGrant | None:
        self.key_checks += 1
        return await super().api_key(tenant_id, key_hash, now)


def _client(app: Any, host: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://publisher.test")


async def test_an_address_with_too_many_failures_gets_429_before_its_key_is_checked() -> None:
    store = CountingStore()
    app, key = app_with_key(
        store, AuthSettings(failed_auth_burst=BURST, failed_auth_per_minute=PER_MINUTE)
    )
    path = "/v1/tenants/acme/index-tasks/00000000-0000-0000-0000-000000000000"
    good = {"Authorization": f"Bearer {key}"}
    wrong = {"Authorization": f"Bearer kb.acme.{'A' * 43}"}
    async with _client(app, "192.0.2.7") as attacker, _client(app, "198.51.100.1") as other:
        # Forwarded headers are not the address: only the peer (uvicorn sets it from them
        # for KB_HTTP_TRUSTED_PROXIES alone).
        tricks = [{}, {"X-Forwarded-For": "203.0.113.1"}, {"X-Real-IP": "203.0.113.2"}]
        with capture_logs() as events:
            for extra in tricks:
                response = await attacker.get(path, headers={**wrong, **extra})
                assert response.status_code == 401
            checks = store.key_checks
            for headers in (wrong, good, {}):
                throttled = await attacker.get(path, headers=headers)
                assert throttled.status_code == 429, throttled.text
                assert throttled.headers["content-type"] == "application/problem+json"
                assert throttled.json()["errorCode"] == "AUTH_FAILURES_THROTTLED"
                assert 1 <= int(throttled.headers["retry-after"]) <= 10
        assert store.key_checks == checks  # nothing looked up for a throttled address
        # Logged once, when the address ran out, not for each refusal.
        assert [e["client_address"] for e in events if e["event"] == "auth.throttled"] == [
            "192.0.2.7"
        ]

        # Another address is served as ever, and its successes count for nothing.
        assert (await other.get(path, headers=good)).status_code == 404
        assert (await other.get(path, headers=wrong)).status_code == 401

        # Routes outside /v1/tenants are not throttled.
        assert (await attacker.get("/healthz")).status_code == 200


async def test_a_valid_key_never_fills_the_bucket() -> None:
    store = CountingStore()
    app, key = app_with_key(store, AuthSettings(failed_auth_burst=1, failed_auth_per_minute=1.0))
    path = "/v1/tenants/acme/index-tasks/00000000-0000-0000-0000-000000000000"
    async with _client(app, "192.0.2.7") as client:
        for _ in range(20):
            response = await client.get(path, headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 404
        # Another tenant's key is a valid key in the wrong place: 403, not a failure.
        globex = {"Authorization": f"Bearer {new_api_key('globex')}"}
        store.add_tenant("globex", "standard", hash_api_key(globex["Authorization"][7:]))
        for _ in range(5):
            assert (await client.get(path, headers=globex)).status_code == 403


async def test_principal_tokens_that_fail_count_as_failures() -> None:
    store = CountingStore()
    key = new_api_key("acme")
    store.add_tenant("acme", "standard", hash_api_key(key))
    app = create_composed_app(
        PublisherSettings(database_url="postgresql://unused/kb"),
        stores=PublisherStores(store),
        searcher=Searcher(HashingEmbedder(DIMENSION), FakeIndex()),
        auth_settings=AuthSettings(failed_auth_burst=BURST, failed_auth_per_minute=PER_MINUTE),
    )
    headers = {"Authorization": f"Bearer {key}"}
    async with _client(app, "192.0.2.9") as client:
        search = {"query": "refunds", "principals": ["group:all"]}
        assert (
            await client.post("/v1/tenants/acme/search", json=search, headers=headers)
        ).status_code == 200
        forged = {"query": "refunds", "principalToken": "a.b.c"}
        for _ in range(BURST):
            response = await client.post("/v1/tenants/acme/search", json=forged, headers=headers)
            assert response.json()["errorCode"] == "PRINCIPAL_TOKEN_INVALID"
        throttled = await client.post("/v1/tenants/acme/search", json=search, headers=headers)
        assert throttled.status_code == 429
