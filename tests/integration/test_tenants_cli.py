"""`kb tenants create` as a user runs it."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import asyncpg
import pytest

from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, publisher_harness, snapshot
from tests.support.cli import kb

pytestmark = pytest.mark.integration


async def test_create_prints_only_the_key_and_stores_its_hash(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], settings: RuntimeSettings
) -> None:
    result = kb(service_env, "tenants", "create", "acme-eu", "--tier", "premium")
    assert result.returncode == 0, result.stderr
    # stdout is exactly one eval-able line.
    printed = re.fullmatch(r"KB_API_KEY=kb\.acme-eu\.[A-Za-z0-9_-]{43}\n", result.stdout)
    assert printed, result.stdout
    key = result.stdout.strip().removeprefix("KB_API_KEY=")

    assert await conn.fetchval("SELECT tier FROM tenant WHERE tenant_id = 'acme-eu'") == "premium"
    stored = await conn.fetchval("SELECT key_hash FROM tenant_api_key WHERE tenant_id = 'acme-eu'")
    assert stored == hashlib.sha256(key.encode()).digest()
    dump = await conn.fetchval("SELECT string_agg(t::text, ',') FROM tenant_api_key t")
    assert key not in dump
    assert key.split(".")[-1] not in dump

    # The printed key opens that tenant's API, and only that tenant's.
    tenant = ApiTenant("acme-eu", "premium", key)
    async with publisher_harness(settings) as api:
        response = await api.client.get(
            tenant.path("/index-tasks/00000000-0000-0000-0000-000000000000"),
            headers=tenant.headers,
        )
        assert response.status_code == 404, response.text
        other = await api.client.get(
            "/v1/tenants/other/index-tasks/00000000-0000-0000-0000-000000000000",
            headers=tenant.headers,
        )
        assert other.status_code == 403


@pytest.mark.parametrize(
    "args",
    [
        # (The name and tier rules themselves: tests/unit/publisher/test_domain.py.)
        ["tenants", "create", "Acme", "--tier", "standard"],
        ["tenants", "create", "acme", "--tier", "Gold Plus"],
        ["tenants", "create", "acme"],
    ],
)
async def test_bad_names_and_tiers_exit_2_and_change_nothing(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], args: list[str]
) -> None:
    before = await snapshot(conn)
    result = kb(service_env, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.strip()
    assert await snapshot(conn) == before


async def test_a_duplicate_tenant_exits_2_and_keeps_the_first_key(
    service_env: dict[str, str], conn: asyncpg.Connection[Any]
) -> None:
    assert kb(service_env, "tenants", "create", "acme", "--tier", "standard").returncode == 0
    before = await snapshot(conn)
    again = kb(service_env, "tenants", "create", "acme", "--tier", "premium")
    assert again.returncode == 2
    assert again.stdout == ""
    assert "TENANT_EXISTS" in again.stderr
    assert await snapshot(conn) == before
