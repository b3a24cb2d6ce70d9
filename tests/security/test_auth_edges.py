"""The edges of authentication (issue 41): principal tokens with duplicate JSON keys, the
failed-key throttle under concurrency and address cycling, key revocation on the
database's clock, and the operator sign-in (its throttle, the length of
KB_OPERATOR_TOKEN, the session cookie's Secure flag)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from typer.testing import CliRunner

from services.operator.context import build_operator_context
from services.operator.routes import mount_operator
from services.operator.settings import OperatorSettings
from services.publisher.cli import tenants_app
from services.publisher.keys import cli as keys_cli
from services.publisher.keys.store_pg import KeySpec, PgKeyStore
from services.publisher.settings import PublisherSettings
from services.publisher.web.api import PublisherStores, create_app
from services.runtime.auth.keys import ApiKeyGrant, Scope, VerificationKey
from services.runtime.auth.settings import AuthSettings
from services.runtime.auth.throttle import FailedAuthThrottle
from services.runtime.auth.tokens import PrincipalTokenInvalid, verify_principal_token
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from tests.fakes.publisher_store import MemoryPublisherStore
from tests.support.api import add_tenant, app_with_key, free_port
from tests.support.cli import kb_async
from tests.support.clock import SecondsClock
from tests.support.operator import OPERATOR_TOKEN, hidden, operator_settings

SECRET = "a-shared-secret-of-at-least-32-bytes!!"
TASK = "/v1/tenants/acme/index-tasks/00000000-0000-0000-0000-000000000000"


# --- principal tokens with duplicate keys ----------------------------------------------------


def _segment(raw_json: str) -> str:
    return base64.urlsafe_b64encode(raw_json.encode()).rstrip(b"=").decode()


def _hs256(header: str, payload: str) -> str:
    """A token signed over exactly these JSON texts (a JWT library would never write a
    duplicate key, an attacker's hand does)."""
    signing_input = f"{_segment(header)}.{_segment(payload)}"
    signature = hmac.new(SECRET.encode(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"


async def _verify(token: str) -> Any:
    async def find_key(kid: str) -> VerificationKey | None:
        return VerificationKey("hs", "HS256", SECRET) if kid == "hs" else None

    return await verify_principal_token(
        token,
        tenant_id="acme",
        find_key=find_key,
        settings=AuthSettings(),
        max_principals=100,
        max_principal_chars=200,
    )


def _claims(principals: str = '["user:alice"]', extra: str = "") -> str:
    now = int(time.time())
    return (
        f'{{"sub": "user:alice", "aud": "kb:acme", "iat": {now}, "exp": {now + 60}, '
        f'"principals": {principals}{extra}}}'
    )


async def test_a_well_formed_hand_made_token_verifies() -> None:
    claims = await _verify(_hs256('{"alg": "HS256", "kid": "hs"}', _claims()))
    assert claims.principals == ("user:alice",)


@pytest.mark.parametrize(
    ("header", "payload"),
    [
        # The payload names its principals twice: the last one would win.
        ('{"alg": "HS256", "kid": "hs"}', _claims('["user:alice"]', ', "principals": ["*"]')),
        ('{"alg": "HS256", "kid": "hs"}', _claims(extra=', "aud": "kb:globex"')),
        # The header names its kid twice.
        ('{"alg": "HS256", "kid": "other", "kid": "hs"}', _claims()),
        # A duplicate inside a nested object counts too.
        ('{"alg": "HS256", "kid": "hs"}', _claims(extra=', "ctx": {"a": 1, "a": 2}')),
    ],
)
async def test_a_token_with_duplicate_json_keys_is_refused(header: str, payload: str) -> None:
    with pytest.raises(PrincipalTokenInvalid) as caught:
        await _verify(_hs256(header, payload))
    assert caught.value.code == "PRINCIPAL_TOKEN_INVALID"
    assert caught.value.http_status == 401
    assert "duplicate" in caught.value.message


# --- the failed-key throttle ----------------------------------------------------------------


class BlockingStore(MemoryPublisherStore):
    """Key lookups wait until released, so that concurrent requests are all in flight at
    once; each lookup sets ``progress``."""

    def __init__(self, progress: asyncio.Event) -> None:
        super().__init__()
        self.key_checks = 0
        self.release = asyncio.Event()
        self.progress = progress

    async def api_key(
        self, tenant_id: str, key_hash: bytes, now: datetime | None = None
    ) -> ApiKeyGrant | None:
        self.key_checks += 1
        self.progress.set()
        await self.release.wait()
        return await super().api_key(tenant_id, key_hash, now)


class ObservedThrottle(FailedAuthThrottle):
    """Counts the requests that came to it for a try, and sets ``progress`` for each."""

    def __init__(self, progress: asyncio.Event, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.arrived = 0
        self.progress = progress

    async def reserve(self, host: str) -> Any:
        self.arrived += 1
        self.progress.set()
        return await super().reserve(host)


async def _until(progress: asyncio.Event, condition: Any) -> None:
    async with asyncio.timeout(60):  # only stops a broken build from hanging
        while not condition():
            await progress.wait()
            progress.clear()


def _observe(app: FastAPI, throttle: FailedAuthThrottle) -> None:
    """Put ``throttle`` in the tenant-auth middleware of ``app``'s (now built) stack."""
    app.middleware_stack = app.build_middleware_stack()
    layer: Any = app.middleware_stack
    while not hasattr(layer, "throttle"):
        layer = layer.app
    layer.throttle = throttle


async def test_concurrent_bad_keys_reach_the_database_at_most_burst_times() -> None:
    burst, attempts = 3, 12
    progress = asyncio.Event()
    store = BlockingStore(progress)
    store.add_tenant("acme", "standard", hash_api_key(new_api_key("acme")))
    app = create_app(PublisherSettings(), stores=PublisherStores(store))
    throttle = ObservedThrottle(progress, burst=burst, per_minute=6.0, max_addresses=100)
    _observe(app, throttle)
    transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 40000))
    wrong = {"Authorization": f"Bearer kb.acme.{'A' * 43}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://publisher.test") as client:
        requests = [asyncio.create_task(client.get(TASK, headers=wrong)) for _ in range(attempts)]
        # Every request is in flight: in a key lookup, or waiting for a try of its address
        # (a request that came for a try and got none has not left: the lookups are held).
        await _until(progress, lambda: throttle.arrived == attempts or store.key_checks > burst)
        store.release.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*requests))
    assert store.key_checks == burst
    assert statuses == [401] * burst + [429] * (attempts - burst)


async def test_valid_keys_are_never_refused_for_their_concurrency() -> None:
    """Reserving a try before the lookup must not cap a good client's concurrency: requests
    beyond the burst wait for a try and get it back when the key is good."""
    progress = asyncio.Event()
    store = BlockingStore(progress)
    app, key = app_with_key(store, AuthSettings(failed_auth_burst=2, failed_auth_per_minute=1.0))
    transport = httpx.ASGITransport(app=app, client=("192.0.2.8", 40000))
    good = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://publisher.test") as client:
        requests = [asyncio.create_task(client.get(TASK, headers=good)) for _ in range(10)]
        await _until(progress, lambda: store.key_checks >= 2)
        store.release.set()
        statuses = [r.status_code for r in await asyncio.gather(*requests)]
    assert statuses == [404] * 10
    assert store.key_checks == 10


def test_ipv6_clients_are_counted_per_the_configured_prefix() -> None:
    clock = SecondsClock(1000.0)
    throttle = FailedAuthThrottle(
        burst=2, per_minute=1.0, max_addresses=100, ipv6_prefix=56, clock=clock
    )
    # Two /64s of one /56: one client.
    throttle.record_failure("2001:db8:1:200::1")
    throttle.record_failure("2001:db8:1:2ff::1")
    assert throttle.retry_after("2001:db8:1:2aa::7") is not None
    assert throttle.retry_after("2001:db8:1:300::1") is None  # the next /56
    assert AuthSettings(failed_auth_ipv6_prefix=56).failed_auth_ipv6_prefix == 56
    with pytest.raises(ValidationError):  # the network must hold the address
        AuthSettings(failed_auth_ipv6_prefix=48, failed_auth_ipv6_network_prefix=56)


def test_cycling_through_the_64s_of_one_48_is_throttled_as_one() -> None:
    clock = SecondsClock(1000.0)
    throttle = FailedAuthThrottle(
        burst=3, per_minute=6.0, max_addresses=10_000, network_multiple=4, clock=clock
    )
    tried = 0
    for n in range(100):  # each /64 tries until it is refused, then the next one
        host = f"2001:db8:7:{n:x}::1"
        while throttle.retry_after(host) is None:
            throttle.record_failure(host)
            tried += 1
    # The /48 as a whole had network_multiple bursts; after them each fresh /64 had one
    # try (a clean /64 is never refused for its neighbours): not 100 /64s times 3 tries.
    assert tried == 3 * 4 + (100 - 4)
    assert throttle.retry_after("2001:db8:7:1::1") is not None  # one that failed
    assert throttle.retry_after("2001:db8:7:ffff::1") is None  # a fresh /64 of it
    assert throttle.retry_after("2001:db8:8::1") is None  # another /48
    assert throttle.retry_after("192.0.2.1") is None
    assert len(throttle) <= 100 + 1


async def test_a_customer_is_not_locked_out_by_its_neighbours_in_one_48() -> None:
    """One customer sending wrong keys from the /64s of a /48 spends the /48's count; another
    customer's /64 in it still authenticates, while a /64 that failed is refused."""
    store = MemoryPublisherStore()
    app, key = app_with_key(
        store,
        AuthSettings(
            failed_auth_burst=2,
            failed_auth_per_minute=1.0,
            failed_auth_ipv6_network_multiple=2,
        ),
    )
    wrong = {"Authorization": f"Bearer kb.acme.{'A' * 43}"}
    good = {"Authorization": f"Bearer {key}"}

    async def get(host: str, headers: dict[str, str]) -> int:
        transport = httpx.ASGITransport(app=app, client=(host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://a.test") as client:
            return (await client.get(TASK, headers=headers)).status_code

    for n in range(2):  # two /64s, two wrong keys each: the /48's four
        assert [await get(f"2001:db8:9:{n}::1", wrong) for _ in range(2)] == [401, 401]
    assert await get("2001:db8:9:0::1", good) == 429  # a /64 that failed
    assert await get("2001:db8:9:5::1", wrong) == 401  # a fresh one: one try
    assert await get("2001:db8:9:5::1", good) == 429  # and then none
    assert [await get("2001:db8:9:77::1", good) for _ in range(5)] == [404] * 5  # clean


def test_addresses_cycled_through_do_not_evict_a_throttled_one() -> None:
    clock = SecondsClock(1000.0)
    throttle = FailedAuthThrottle(burst=3, per_minute=6.0, max_addresses=100, clock=clock)
    for _ in range(3):
        throttle.record_failure("192.0.2.66")
    assert throttle.retry_after("192.0.2.66") is not None
    # One failure from each of 1,000 other addresses (a botnet, or one host's IPv4 pool).
    for i in range(1000):
        throttle.record_failure(f"10.1.{i // 256}.{i % 256}")
    assert len(throttle) <= 100
    assert throttle.retry_after("192.0.2.66") is not None  # still throttled
    # Forgetting happens as the buckets refill: the throttled one goes last.
    clock.now += 30
    assert throttle.retry_after("192.0.2.66") is None


# --- revocation on the database's clock -----------------------------------------------------


class _MachineClockADayBehind(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return datetime.now(tz) - timedelta(days=1)


@contextmanager
def _machine_clock_a_day_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The commands' module keeps no clock of its own once fixed: nothing to replace then.
    monkeypatch.setattr(keys_cli, "datetime", _MachineClockADayBehind, raising=False)
    yield


async def _database_now(conn: asyncpg.Connection[Any]) -> datetime:
    value: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return value


def _on_a_connection_of(database_url: str) -> Any:
    """What the commands run their work with, minus their logging set-up (which would
    outlive the test in this process)."""

    def run(work: Any) -> Any:
        async def go() -> Any:
            connection = await asyncpg.connect(database_url)
            try:
                return await work(connection)
            finally:
                await connection.close()

        return asyncio.run(go())

    return run


@pytest.mark.integration
async def test_revoke_and_rotate_use_the_database_clock(
    conn: asyncpg.Connection[Any], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await add_tenant(conn, "acme")
    store = PgKeyStore(conn)
    spec = KeySpec(frozenset({Scope.PUBLISH}))
    revoked = await store.create_key("acme", hash_api_key(new_api_key("acme")), spec)
    rotated = await store.create_key("acme", hash_api_key(new_api_key("acme")), spec)
    monkeypatch.setattr(keys_cli, "run_with_connection", _on_a_connection_of(database_url))
    runner = CliRunner()
    with _machine_clock_a_day_behind(monkeypatch):
        before = await _database_now(conn)
        done = await asyncio.to_thread(
            runner.invoke, tenants_app, ["keys", "revoke", "acme", str(revoked)]
        )
        assert done.exit_code == 0, done.output
        done = await asyncio.to_thread(
            runner.invoke,
            tenants_app,
            ["keys", "rotate", "acme", str(rotated), "--grace-seconds", "3600"],
        )
        assert done.exit_code == 0, done.output
        after = await _database_now(conn)
    revoked_at = await conn.fetchval(
        "SELECT revoked_at FROM tenant_api_key WHERE key_id = $1", revoked
    )
    assert before <= revoked_at <= after  # not the machine's clock, a day behind
    rotated_until = await conn.fetchval(
        "SELECT revoked_at FROM tenant_api_key WHERE key_id = $1", rotated
    )
    grace = timedelta(seconds=3600)
    assert before + grace <= rotated_until <= after + grace


@pytest.mark.integration
async def test_revoke_without_a_time_takes_the_transactions_now(
    conn: asyncpg.Connection[Any],
) -> None:
    await add_tenant(conn, "acme")
    store = PgKeyStore(conn)
    key_id = await store.create_key(
        "acme", hash_api_key(new_api_key("acme")), KeySpec(frozenset({Scope.PUBLISH}))
    )
    async with conn.transaction():
        assert await store.revoke_key("acme", key_id)
        assert await conn.fetchval(
            "SELECT revoked_at = now() FROM tenant_api_key WHERE key_id = $1", key_id
        )


# --- the operator sign-in -------------------------------------------------------------------


@asynccontextmanager
async def _operator_app(
    pool: asyncpg.Pool[Any], settings: OperatorSettings
) -> AsyncIterator[FastAPI]:
    app = FastAPI()
    mount_operator(app, build_operator_context(pool, settings))
    yield app


def _from(app: FastAPI, host: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="https://operator.test")


async def _sign_in(client: httpx.AsyncClient, token: str) -> httpx.Response:
    form = await client.get("/ui/login")
    return await client.post(
        "/ui/login", data={"token": token, "login_token": hidden(form.text, "login_token")}
    )


@pytest.mark.integration
async def test_failed_sign_ins_are_throttled_per_address(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    settings = operator_settings(
        database_url, operator_sign_in_burst=3, operator_sign_in_per_minute=1.0
    )
    async with (
        _operator_app(pool, settings) as app,
        _from(app, "192.0.2.7") as attacker,
        _from(app, "198.51.100.1") as other,
    ):
        for n in range(3):
            refused = await _sign_in(attacker, f"kbop.wrong-{n}")
            assert (refused.status_code, refused.headers["location"]) == (303, "/ui/login?error=1")
        throttled = await _sign_in(attacker, OPERATOR_TOKEN)  # even the right key
        assert throttled.status_code == 429
        assert 1 <= int(throttled.headers["retry-after"]) <= 60
        assert "kb_operator_session" not in throttled.headers.get("set-cookie", "")
        assert 'id="login-throttled"' in throttled.text
        # Another address signs in as ever.
        accepted = await _sign_in(other, OPERATOR_TOKEN)
        assert (accepted.status_code, accepted.headers["location"]) == (303, "/ui")


@pytest.mark.integration
async def test_the_session_cookie_is_secure_unless_turned_off(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    assert OperatorSettings.model_fields["operator_secure_cookie"].default is True
    for secure in (True, False):
        settings = operator_settings(database_url, operator_secure_cookie=secure)
        async with _operator_app(pool, settings) as app, _from(app, "192.0.2.9") as client:
            signed_in = await _sign_in(client, OPERATOR_TOKEN)
            assert signed_in.status_code == 303
            cookies = signed_in.headers.get_list("set-cookie")
            session = [c for c in cookies if c.startswith("kb_operator_session=")]
            assert len(session) == 1
            assert ("; secure" in session[0].lower()) is secure


def test_a_short_operator_token_is_refused() -> None:
    with pytest.raises(ValidationError):
        OperatorSettings(operator_token="x" * 31)
    assert OperatorSettings(operator_token="x" * 32).operator_token is not None


@pytest.mark.integration
async def test_kb_serve_refuses_a_short_operator_token_without_printing_it(
    service_env: dict[str, str],
) -> None:
    short = f"short-{uuid.uuid4().hex[:8]}"
    env = {**service_env, "KB_OPERATOR_TOKEN": short, "KB_EMBEDDING_PROVIDER": "hashing"}
    code, out, err = await kb_async(env, "serve", "--port", str(free_port()), seconds=60)
    assert code == 2, err
    assert "KB_OPERATOR_TOKEN" in err or "operator_token" in err
    assert short not in out + err
    assert json.dumps(short) not in out + err
