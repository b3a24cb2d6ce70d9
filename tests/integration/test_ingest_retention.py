"""The retention of refused commands' records (``ingest_refusal``, migration 0036): those
older than ``KB_INGEST_REFUSAL_RETENTION_DAYS`` go, every tenant's, a batch at a time; the
younger ones stay, and still keep a redelivered run from dead-lettering again."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.publisher.ingest.retention import RefusalRetention
from services.publisher.ingest.store_pg import PgIngestStore
from tests.support.api import add_tenant

pytestmark = pytest.mark.integration

NOW = datetime(2026, 12, 7, 2, 0, tzinfo=UTC)


async def _refused(store: PgIngestStore, tenant: str, offset: int, days_ago: float) -> str:
    source = f"kb.ingest.standard/0/{offset}"
    async with store.ingest_transaction(tenant) as tx:
        await tx.record_refusal(
            tenant, source, uuid.uuid4(), "INGEST_COMMAND_INVALID", NOW - timedelta(days=days_ago)
        )
    return source


async def _kept(conn: asyncpg.Connection[Any]) -> set[tuple[str, str]]:
    rows = await conn.fetch("SELECT tenant_id, source FROM ingest_refusal")
    return {(row["tenant_id"], row["source"]) for row in rows}


async def test_refusals_older_than_the_horizon_go_every_tenants_the_younger_stay(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    for name in ("acme", "beta"):
        await add_tenant(conn, name)
    store = PgIngestStore(pool)
    old = [
        ("acme", await _refused(store, "acme", 1, 45)),
        ("acme", await _refused(store, "acme", 2, 30.01)),
        ("beta", await _refused(store, "beta", 3, 31)),
    ]
    young = {
        ("acme", await _refused(store, "acme", 4, 29.99)),
        ("beta", await _refused(store, "beta", 5, 1)),
    }
    assert await _kept(conn) == {*old, *young}

    # Kept forever with 0 days.
    assert await RefusalRetention(store, days=0).collect(NOW) == 0
    assert await _kept(conn) == {*old, *young}

    # Three past the horizon, in batches of two: two statements, then one not full.
    assert await RefusalRetention(store, days=30, batch=2).collect(NOW) == 3
    assert await _kept(conn) == young
    async with store.ingest_transaction("acme") as tx:
        sent = await tx.refusals_sent("acme", [source for _, source in young])
    assert sent == {"kb.ingest.standard/0/4": "INGEST_COMMAND_INVALID"}
    assert await RefusalRetention(store, days=30, batch=2).collect(NOW) == 0
