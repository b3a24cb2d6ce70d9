"""The retention of the ingest consumer's records: refused commands' (``ingest_refusal``,
migration 0036) older than ``KB_INGEST_REFUSAL_RETENTION_DAYS``, and applied commands'
(``ingest_command``) older than ``KB_INGEST_COMMAND_RETENTION_DAYS``, go, every tenant's, a
batch at a time; the younger ones stay, and still keep a redelivered command from being
dead-lettered or applied again. A command record whose index task is still to run stays."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.publisher.domain import Publisher
from services.publisher.ingest.apply import IngestApplier
from services.publisher.ingest.commands import decode_command
from services.publisher.ingest.retention import IngestRetention
from services.publisher.ingest.store_pg import PgIngestStore
from services.runtime.erasure.erase_pg import PgErasureStore
from tests.support.api import add_tenant
from tests.support.ingest import publish_command

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
    assert await IngestRetention(store, refusal_days=0).collect(NOW) == 0
    assert await _kept(conn) == {*old, *young}

    # Three past the horizon, in batches of two: two statements, then one not full.
    assert await IngestRetention(store, refusal_days=30, batch=2).collect(NOW) == 3
    assert await _kept(conn) == young
    async with store.ingest_transaction("acme") as tx:
        sent = await tx.refusals_sent("acme", [source for _, source in young])
    assert sent == {"kb.ingest.standard/0/4": "INGEST_COMMAND_INVALID"}
    assert await IngestRetention(store, refusal_days=30, batch=2).collect(NOW) == 0


async def _applied(store: PgIngestStore, tenant: str, days_ago: float) -> tuple[str, uuid.UUID]:
    command = decode_command(publish_command(tenant, "page"), max_inline_bytes=1 << 20)
    async with store.ingest_transaction(tenant) as tx:
        assert await tx.claim_commands(tenant, [(command, None)], NOW - timedelta(days=days_ago))
    return tenant, command.command_id


async def _recorded(conn: asyncpg.Connection[Any]) -> set[tuple[str, uuid.UUID]]:
    rows = await conn.fetch("SELECT tenant_id, command_id FROM ingest_command")
    return {(row["tenant_id"], row["command_id"]) for row in rows}


async def test_command_records_older_than_the_horizon_go_every_tenants_the_younger_stay(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    for name in ("acme", "beta"):
        await add_tenant(conn, name)
    store = PgIngestStore(pool)
    old = {
        await _applied(store, "acme", 45),
        await _applied(store, "acme", 30.01),
        await _applied(store, "beta", 31),
    }
    young = {await _applied(store, "acme", 29.99), await _applied(store, "beta", 1)}
    refused = await _refused(store, "acme", 1, 45)

    # Kept forever with 0 days; the refusals' horizon is not the commands'.
    assert await IngestRetention(store, refusal_days=0, command_days=0).collect(NOW) == 0
    assert await _recorded(conn) == {*old, *young}

    # Three past the horizon, in batches of two: two statements, then one not full.
    retention = IngestRetention(store, refusal_days=0, command_days=30, batch=2)
    assert await retention.collect(NOW) == 3
    assert await _recorded(conn) == young
    assert await _kept(conn) == {("acme", refused)}
    assert await retention.collect(NOW) == 0

    # A young record still answers its command's redelivery: claimed before, not again.
    _, command_id = next(iter(sorted(young)))
    async with store.ingest_transaction("acme") as tx:
        assert await tx.command_answers("acme", [command_id])


async def test_a_command_record_stays_while_its_index_task_is_to_run(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    # The indexer's switch and dead events name the command that created the task from its
    # record: it stays past the horizon until the task is done.
    await add_tenant(conn, "acme")
    store = PgIngestStore(pool)
    publisher = Publisher(store, max_upload_bytes=1 << 20, erasure=PgErasureStore(pool))
    applier = IngestApplier(publisher, store, max_upload_bytes=1 << 20)
    answer = await applier.apply(
        decode_command(publish_command("acme", "page"), max_inline_bytes=1 << 20)
    )
    assert answer.task_id is not None
    later = await conn.fetchval("SELECT now() + interval '60 days'")
    retention = IngestRetention(store, refusal_days=0, command_days=30)

    assert await retention.collect(later) == 0
    assert await _recorded(conn) == {("acme", answer.command_id)}

    await conn.execute(
        "UPDATE index_task SET status = 'DEAD', finished_at = now() WHERE task_id = $1",
        answer.task_id,
    )
    assert await retention.collect(later) == 1
    assert await _recorded(conn) == set()
