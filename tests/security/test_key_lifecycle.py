"""Keys over their life (issue 29): `kb tenants keys create|list|rotate|revoke` and
`kb tenants verification-keys add|list|remove` as a user runs them; a revoked or rotated key
fails on the very next request (nothing caches a key check), a rotation's grace period
keeps the old key working until it ends, and only hashes are stored."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from typer.testing import CliRunner

from services.publisher.cli import tenants_app
from services.publisher.keys.store_pg import KeySpec, PgKeyStore
from services.runtime.auth.keys import PgTenantCredentials, PrincipalSource, Scope
from services.runtime.errors import BadInput
from services.runtime.pg.migrations import apply_migrations, load_migrations
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from tests.support.api import ApiTenant, add_tenant, publisher_harness
from tests.support.cli import kb
from tests.support.stack import Stack, create_test_database, drop_test_database

pytestmark = pytest.mark.integration

TASK = "/index-tasks/00000000-0000-0000-0000-000000000000"


def _printed_key(stdout: str, tenant: str) -> tuple[str, str]:
    match = re.fullmatch(
        rf"KB_API_KEY_ID=(?P<id>[0-9a-f-]{{36}})\nKB_API_KEY=(?P<key>kb\.{tenant}\.[A-Za-z0-9_-]{{43}})\n",
        stdout,
    )
    assert match, stdout
    return match["id"], match["key"]


async def test_the_key_commands_as_a_user_runs_them(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], tmp_path: Path
) -> None:
    await add_tenant(conn, "acme")
    created = kb(
        service_env,
        "tenants", "keys", "create", "acme",
        "--scope", "search", "--principals", "group:support,user:bob", "--name", "portal",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    key_id, key = _printed_key(created.stdout, "acme")
    stored = await conn.fetchrow(
        "SELECT key_hash, scopes, principal_source, principals FROM tenant_api_key"
        " WHERE key_id = $1",
        uuid.UUID(key_id),
    )
    assert stored is not None
    assert stored["key_hash"] == hash_api_key(key)
    assert (stored["scopes"], stored["principal_source"]) == (["search"], "fixed")
    assert stored["principals"] == ["group:support", "user:bob"]
    dump = await conn.fetchval("SELECT string_agg(t::text, ',') FROM tenant_api_key t")
    assert key.split(".")[-1] not in dump
    assert key not in created.stderr

    rotated = kb(service_env, "tenants", "keys", "rotate", "acme", key_id)
    assert rotated.returncode == 0, rotated.stderr
    new_id, new_key = _printed_key(rotated.stdout, "acme")
    # A key rotated once has its successor: a second rotation is refused (exit 2).
    again = kb(service_env, "tenants", "keys", "rotate", "acme", key_id)
    assert (again.returncode, again.stdout) == (2, ""), again.stderr
    assert "KEY_NOT_FOUND" in again.stderr

    public = ed25519.Ed25519PrivateKey.generate().public_key()
    pem = tmp_path / "idp.pem"
    pem.write_bytes(
        public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    added = kb(
        service_env, "tenants", "verification-keys", "add", "acme", "--kid", "idp-1",
        "--public-key-file", str(pem),
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    listed = kb(service_env, "tenants", "keys", "list", "acme", "--json")
    assert listed.returncode == 0, listed.stderr
    keys = {k["keyId"]: k for k in json.loads(listed.stdout)}
    assert keys[key_id]["active"] is False
    assert keys[key_id]["replacedBy"] == new_id
    assert keys[new_id] | {"createdAt": None} == {
        "keyId": new_id,
        "name": "portal",
        "scopes": ["search"],
        "principalSource": "fixed",
        "principals": ["group:support", "user:bob"],
        "createdAt": None,
        "revokedAt": None,
        "replacedBy": None,
        "active": True,
    }
    assert new_key not in listed.stdout
    assert (
        await conn.fetchval(
            "SELECT algorithm FROM tenant_verification_key"
            " WHERE tenant_id = 'acme' AND kid = 'idp-1'"
        )
        == "EdDSA"
    )


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["keys", "create", "acme"], "KEY_SCOPE_INVALID"),
        (["keys", "create", "acme", "--scope", "owner"], "KEY_SCOPE_INVALID"),
        (["keys", "create", "acme", "--scope", "admin", "--principals", "g:a"],
         "KEY_PRINCIPALS_INVALID"),
        (["keys", "create", "acme", "--scope", "search,publish", "--require-principal-token"],
         "KEY_PRINCIPALS_INVALID"),
        (["keys", "create", "acme", "--scope", "search", "--principals", "g:a",
          "--require-principal-token"], "KEY_PRINCIPALS_INVALID"),
        (["keys", "create", "acme", "--scope", "search", "--principals", " , "],
         "KEY_PRINCIPALS_INVALID"),
        (["keys", "create", "Acme", "--scope", "search"], "TENANT_NAME_INVALID"),
        (["keys", "revoke", "acme", "not-a-uuid"], "KEY_ID_INVALID"),
        (["verification-keys", "add", "acme", "--kid", "k/1", "--hmac-secret-file", "-"],
         "VERIFICATION_KEY_INVALID"),
        (["verification-keys", "add", "acme", "--kid", "k", "--public-key-file", "/dev/null"],
         "VERIFICATION_KEY_INVALID"),
        (["verification-keys", "add", "acme", "--kid", "k", "--hmac-secret-file", "-"],
         "VERIFICATION_KEY_INVALID"),  # stdin: a secret shorter than 32 bytes
        (["verification-keys", "add", "acme", "--kid", "k", "--hmac-secret-file", "-",
          "--algorithm", "RS256"], "VERIFICATION_KEY_INVALID"),
    ],
)  # fmt: skip
def test_bad_key_commands_are_refused_before_the_database(args: list[str], code: str) -> None:
    # In-process: these are refused before any connection is opened (no DATABASE_URL is
    # reachable here), as `kb` would refuse them with exit 2.
    result = CliRunner().invoke(tenants_app, args, input="short-secret\n")
    assert isinstance(result.exception, BadInput), result.output
    assert result.exception.code == code
    assert result.stdout == ""


async def test_revocation_and_rotation_hold_from_the_next_request(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    admin = await add_tenant(conn, "acme")
    store = PgKeyStore(conn)
    keys = {}
    for name in ("revoked", "rotated", "graced"):
        key = new_api_key("acme")
        keys[name] = (
            await store.create_key("acme", hash_api_key(key), KeySpec(frozenset({Scope.PUBLISH}))),
            key,
        )
    async with publisher_harness(settings) as api:

        async def status(key: str) -> int:
            response = await api.client.get(
                ApiTenant("acme", "standard", key).path(TASK),
                headers={"Authorization": f"Bearer {key}"},
            )
            return response.status_code

        assert {await status(key) for _, key in keys.values()} == {404}
        now = datetime.now(UTC)
        assert await store.revoke_key("acme", keys["revoked"][0], now)
        assert await status(keys["revoked"][1]) == 401

        successor = new_api_key("acme")
        await store.rotate_key(
            "acme", keys["rotated"][0], hash_api_key(successor), old_key_until=now
        )
        assert await status(keys["rotated"][1]) == 401
        assert await status(successor) == 404

        graced = new_api_key("acme")
        await store.rotate_key(
            "acme", keys["graced"][0], hash_api_key(graced), old_key_until=now + timedelta(hours=1)
        )
        assert await status(keys["graced"][1]) == 404  # still in its grace period
        assert await status(graced) == 404
        # Revoking during the grace period ends it at once; revoking again changes nothing.
        assert await store.revoke_key("acme", keys["graced"][0], datetime.now(UTC))
        assert await status(keys["graced"][1]) == 401
        assert not await store.revoke_key("acme", keys["graced"][0], datetime.now(UTC))
        # A rotated key cannot be rotated a second time (two successors for one key).
        with pytest.raises(Exception, match="KEY_NOT_FOUND"):
            await store.rotate_key(
                "acme", keys["graced"][0], hash_api_key(new_api_key("acme")), old_key_until=now
            )
        assert await status(admin.key) == 404  # the tenant's first key: an admin key


async def test_keys_made_before_scopes_keep_working_as_admin_keys(stack: Stack) -> None:
    """Migration 0025 on a database holding keys: each becomes an admin key that takes the
    caller's principals, and a revoked one stays revoked."""
    name = await create_test_database(stack, "template0")
    conn = await asyncpg.connect(stack.database_url(name))
    try:
        await apply_migrations(conn, [m for m in load_migrations() if m.version < 25])
        await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ('acme', 'standard')")
        live, revoked = new_api_key("acme"), new_api_key("acme")
        for key, revoked_at in ((live, None), (revoked, datetime.now(UTC))):
            await conn.execute(
                "INSERT INTO tenant_api_key (key_id, tenant_id, key_hash, revoked_at)"
                " VALUES ($1, 'acme', $2, $3)",
                uuid.uuid4(),
                hash_api_key(key),
                revoked_at,
            )
        await apply_migrations(conn)
        credentials = PgTenantCredentials(lambda: _Borrowed(conn))
        grant = await credentials.api_key("acme", hash_api_key(live))
        assert grant is not None
        assert (grant.scopes, grant.principal_source) == (
            frozenset({Scope.ADMIN}),
            PrincipalSource.CALLER,
        )
        assert grant.allows(Scope.PUBLISH)
        assert grant.allows(Scope.SEARCH)
        assert await credentials.api_key("acme", hash_api_key(revoked)) is None
    finally:
        await conn.close()
        await drop_test_database(stack, name)


class _Borrowed:
    """One connection, lent as a pool's ``acquire`` would."""

    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self._conn = conn

    async def __aenter__(self) -> asyncpg.Connection[Any]:
        return self._conn

    async def __aexit__(self, *_: object) -> None:
        return None
