"""`kb tenants ingest-keys add|list|revoke` as an operator runs them, and the admin API's
routes: a revoked key no longer verifies a command (docs/security.md#publish-by-event)."""

from __future__ import annotations

import base64
from typing import Any

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.publisher.ingest.signing import public_bytes
from services.publisher.ingest.store_pg import PgIngestStore
from services.runtime.settings import RuntimeSettings
from tests.support.api import add_tenant, publisher_harness
from tests.support.cli import kb

pytestmark = pytest.mark.integration


async def test_add_list_revoke(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], pool: asyncpg.Pool[Any]
) -> None:
    await add_tenant(conn, "acme")
    raw = public_bytes(Ed25519PrivateKey.generate())
    encoded = base64.b64encode(raw).decode()
    added = kb(service_env, "tenants", "ingest-keys", "add", "acme", "k1", "--public-key", encoded)
    assert added.returncode == 0, added.stderr
    store = PgIngestStore(pool)
    key = (await store.ingest_keys("acme", ["k1"])).get("k1")
    assert key is not None
    assert key.public_key == raw
    # Another tenant's lookup of the same id finds nothing.
    assert (await store.ingest_keys("beta", ["k1"])).get("k1") is None

    again = kb(service_env, "tenants", "ingest-keys", "add", "acme", "k1", "--public-key", encoded)
    assert again.returncode == 2
    assert "INGEST_KEY_EXISTS" in again.stderr

    listed = kb(service_env, "tenants", "ingest-keys", "list", "acme")
    assert listed.stdout.split("\t")[:2] == ["k1", encoded]

    revoked = kb(service_env, "tenants", "ingest-keys", "revoke", "acme", "k1")
    assert revoked.returncode == 0, revoked.stderr
    assert (await store.ingest_keys("acme", ["k1"])).get("k1") is None
    twice = kb(service_env, "tenants", "ingest-keys", "revoke", "acme", "k1")
    assert twice.returncode == 2


@pytest.mark.parametrize(
    ("key_id", "public_key"),
    [
        ("k1", base64.b64encode(b"x" * 31).decode()),
        ("bad id!", base64.b64encode(b"x" * 32).decode()),
    ],
)
async def test_a_bad_key_exits_2_and_stores_nothing(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], key_id: str, public_key: str
) -> None:
    await add_tenant(conn, "acme")
    result = kb(
        service_env, "tenants", "ingest-keys", "add", "acme", key_id, "--public-key", public_key
    )
    assert result.returncode == 2
    assert "INGEST_KEY_INVALID" in result.stderr
    assert await conn.fetchval("SELECT count(*) FROM tenant_ingest_key") == 0


async def test_an_admin_key_registers_and_revokes_an_ingest_key_over_http(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any], pool: asyncpg.Pool[Any]
) -> None:
    acme = await add_tenant(conn, "acme")
    raw = public_bytes(Ed25519PrivateKey.generate())
    body = {"keyId": "k1", "publicKey": base64.urlsafe_b64encode(raw).decode().rstrip("=")}
    async with publisher_harness(settings) as api:
        added = await api.client.post(acme.path("/ingest-keys"), json=body, headers=acme.headers)
        assert added.status_code == 201, added.text
        assert added.json()["keyId"] == "k1"
        again = await api.client.post(acme.path("/ingest-keys"), json=body, headers=acme.headers)
        assert again.status_code == 409
        assert again.json()["errorCode"] == "INGEST_KEY_EXISTS"
        store = PgIngestStore(pool)
        key = (await store.ingest_keys("acme", ["k1"])).get("k1")
        assert key is not None
        assert key.public_key == raw
        beta = await add_tenant(conn, "beta")
        other = {**body, "keyId": "k2"}
        assert (
            await api.client.post(beta.path("/ingest-keys"), json=other, headers=beta.headers)
        ).status_code == 201
        listed = await api.client.get(acme.path("/ingest-keys"), headers=acme.headers)
        assert listed.status_code == 200, listed.text
        [entry] = listed.json()["keys"]
        assert (entry["keyId"], entry["revokedAt"]) == ("k1", None)
        assert base64.b64decode(entry["publicKey"]) == raw

        revoked = await api.client.delete(acme.path("/ingest-keys/k1"), headers=acme.headers)
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["revokedAt"] is not None
        assert (await store.ingest_keys("acme", ["k1"])).get("k1") is None
        after = await api.client.get(acme.path("/ingest-keys"), headers=acme.headers)
        [entry] = after.json()["keys"]  # a revoked key stays listed, with when
        assert entry["revokedAt"] == revoked.json()["revokedAt"]
        gone = await api.client.delete(acme.path("/ingest-keys/k1"), headers=acme.headers)
        assert gone.status_code == 404
        assert gone.json()["errorCode"] == "INGEST_KEY_NOT_FOUND"
