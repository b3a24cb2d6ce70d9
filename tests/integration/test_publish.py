"""Publish: one transaction (version + ACL + revision + task + outbox), idempotent, serialised."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.runtime.messaging.avro import default_registry
from services.runtime.pg.db import _init_connection
from services.runtime.settings import RuntimeSettings
from tests.support.api import (
    ApiTenant,
    Harness,
    add_tenant,
    publish,
    publisher_harness,
    snapshot,
    upload,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[Harness]:
    async with publisher_harness(settings) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "premium")


async def _draft(api: Harness, tenant: ApiTenant) -> str:
    response = await upload(api.client, tenant)
    assert response.status_code == 201, response.text
    document_id: str = response.json()["documentId"]
    return document_id


async def _outbox(conn: asyncpg.Connection[Any]) -> list[asyncpg.Record]:
    return await conn.fetch("SELECT * FROM outbox ORDER BY position")


async def test_publish_writes_version_acl_revision_task_and_events_together(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    response = await publish(api.client, acme, document_id, 1, 1, read=["group:support", "u:ann"])
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["documentId"] == document_id
    assert body["versionNumber"] == 1
    assert body["revision"] == 2
    task_id = uuid.UUID(body["indexTaskId"])
    doc = uuid.UUID(document_id)

    assert (
        await conn.fetchval(
            "SELECT status FROM document_version WHERE document_id = $1 AND version_number = 1", doc
        )
        == "PUBLISHED"
    )
    row = await conn.fetchrow("SELECT * FROM document WHERE document_id = $1", doc)
    assert row is not None
    assert (row["revision"], row["published_version"]) == (2, 1)
    assert row["published_at"] is not None
    # The version's ACL; search applies it once the version is served (migration 0024).
    acl = await conn.fetch(
        "SELECT principal, permission FROM document_version_acl"
        " WHERE document_id = $1 AND version_number = 1 ORDER BY 1",
        doc,
    )
    assert [(r["principal"], r["permission"]) for r in acl] == [
        ("group:support", "READ"),
        ("u:ann", "READ"),
    ]
    task = await conn.fetchrow("SELECT * FROM index_task WHERE task_id = $1", task_id)
    assert task is not None
    assert task["status"] == "PENDING"
    assert task["tier"] == "premium"
    assert task["task_type"] == "INDEX_VERSION"
    assert task["tenant_id"] == "acme"
    assert task["next_attempt_at"] <= await conn.fetchval("SELECT now()")

    events = await _outbox(conn)
    assert [e["event_type"] for e in events] == ["IndexTaskCreated", "DocumentVersionPublished"]
    registry = default_registry()
    for event in events:
        assert event["tenant_id"] == "acme"
        assert event["tier"] == "premium"
        assert event["aggregate_key"] == f"acme/{document_id}"
        decoded = registry.decode(bytes(event["payload"]))
        assert decoded.event_type == event["event_type"]
        assert decoded.record["eventId"] == event["event_id"]
        assert decoded.record["documentId"] == doc
        assert decoded.record["versionNumber"] == 1
    created = registry.decode(bytes(events[0]["payload"])).record
    assert created["taskId"] == task_id
    published = registry.decode(bytes(events[1]["payload"])).record
    assert published["revision"] == 2
    assert published["readPrincipals"] == ["group:support", "u:ann"]
    assert published["indexTaskId"] == task_id
    assert published["previousPublishedVersion"] is None


async def test_repeated_publish_answers_the_same_task_and_adds_no_event(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    first = await publish(api.client, acme, document_id, 1, 1)
    assert first.status_code == 202, first.text
    state_after_first = await snapshot(conn)

    # The client timed out and retries with the revision it had: same answer, no change.
    for _ in range(3):
        again = await publish(api.client, acme, document_id, 1, 1)
        assert again.status_code == 202, again.text
        assert again.json() == first.json()
    assert await snapshot(conn) == state_after_first
    assert await conn.fetchval("SELECT count(*) FROM index_task") == 1
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 2


async def test_a_real_change_gets_its_own_event_but_keeps_the_task(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    first = (await publish(api.client, acme, document_id, 1, 1, read=["a"])).json()
    # Same version, new ACL: a change (revision 3, one more event) on the same task.
    second = await publish(api.client, acme, document_id, 1, 2, read=["a", "b"])
    assert second.status_code == 202, second.text
    assert second.json()["revision"] == 3
    assert second.json()["indexTaskId"] == first["indexTaskId"]
    events = await _outbox(conn)
    assert [e["event_type"] for e in events] == [
        "IndexTaskCreated",
        "DocumentVersionPublished",
        "DocumentVersionPublished",
    ]
    assert len({e["event_id"] for e in events}) == 3
    assert await conn.fetchval("SELECT count(*) FROM index_task") == 1

    # A new version: a new task and both events again.
    await upload(api.client, acme, b"v2", document_id=document_id)
    third = await publish(api.client, acme, document_id, 2, 4, read=["a", "b"])
    assert third.status_code == 202, third.text
    assert third.json()["indexTaskId"] != first["indexTaskId"]
    assert await conn.fetchval("SELECT count(*) FROM index_task") == 2
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 5
    last = default_registry().decode(bytes((await _outbox(conn))[-1]["payload"])).record
    assert last["previousPublishedVersion"] == 1


async def test_stale_revision_is_409_with_the_current_one_and_changes_nothing(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    await upload(api.client, acme, b"v2", document_id=document_id)  # revision 2
    before = await snapshot(conn)
    for revision in (1, 3, 9_000_000_000):
        response = await publish(api.client, acme, document_id, 2, revision)
        assert response.status_code == 409, response.text
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["errorCode"] == "REVISION_CONFLICT"
        assert problem["currentRevision"] == 2
    assert await snapshot(conn) == before
    assert (await publish(api.client, acme, document_id, 2, 2)).status_code == 202


async def test_an_older_version_than_the_published_one_is_refused(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    await upload(api.client, acme, b"v2", document_id=document_id)
    assert (await publish(api.client, acme, document_id, 2, 2)).status_code == 202
    before = await snapshot(conn)
    response = await publish(api.client, acme, document_id, 1, 3)
    assert response.status_code == 409
    assert response.json()["errorCode"] == "VERSION_SUPERSEDED"
    assert await snapshot(conn) == before


async def test_concurrent_publishes_with_the_same_revision_one_wins(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    await upload(api.client, acme, b"v2", document_id=document_id)  # revision 2
    # Hold the document row so both requests are inside their transaction, waiting on the
    # same lock, before either can commit: a real race, decided by the row lock.
    async with conn.transaction():
        await conn.execute(
            "SELECT 1 FROM document WHERE document_id = $1 FOR UPDATE", uuid.UUID(document_id)
        )
        racing = [
            asyncio.ensure_future(publish(api.client, acme, document_id, 1, 2, read=["a"])),
            asyncio.ensure_future(publish(api.client, acme, document_id, 2, 2, read=["b"])),
        ]
        await _wait_for_lock_waiters(conn, 2)
    responses = await asyncio.gather(*racing)
    assert sorted(r.status_code for r in responses) == [202, 409]
    loser = next(r for r in responses if r.status_code == 409)
    assert loser.json()["currentRevision"] == 3
    assert await conn.fetchval("SELECT count(*) FROM index_task") == 1
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 2
    assert await conn.fetchval("SELECT revision FROM document") == 3


async def test_concurrent_identical_publishes_make_one_task_and_one_change(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await _draft(api, acme)
    async with conn.transaction():
        await conn.execute(
            "SELECT 1 FROM document WHERE document_id = $1 FOR UPDATE", uuid.UUID(document_id)
        )
        racing = [
            asyncio.ensure_future(publish(api.client, acme, document_id, 1, 1)) for _ in range(3)
        ]
        await _wait_for_lock_waiters(conn, 3)
    responses = await asyncio.gather(*racing)
    # The same change three times is one change: every caller gets the same task.
    assert [r.status_code for r in responses] == [202, 202, 202]
    assert len({r.json()["indexTaskId"] for r in responses}) == 1
    assert await conn.fetchval("SELECT count(*) FROM index_task") == 1
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 2


async def _wait_for_lock_waiters(conn: asyncpg.Connection[Any], count: int) -> None:
    """Until ``count`` other sessions of this database wait on a lock (no fixed sleep)."""
    async with asyncio.timeout(10):
        while True:
            # Inside a transaction pg_stat_activity is a snapshot: take a fresh one each time.
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            waiting = await conn.fetchval(
                """
                SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                """
            )
            if waiting >= count:
                return
            await asyncio.sleep(0.01)


# Every write statement of the publish transaction, in order, and a trigger that makes that
# statement fail. Whichever fails, the transaction leaves nothing behind.
_FAILURE_POINTS = {
    "mark_version_published": ("document_version", "UPDATE", "true"),
    "set_published_version": ("document", "UPDATE", "true"),
    "delete_acl": ("document_version_acl", "DELETE", "true"),
    "insert_acl": ("document_version_acl", "INSERT", "true"),
    "insert_index_task": ("index_task", "INSERT", "true"),
    "outbox_index_task_created": ("outbox", "INSERT", "NEW.event_type = 'IndexTaskCreated'"),
    "outbox_version_published": (
        "outbox",
        "INSERT",
        "NEW.event_type = 'DocumentVersionPublished'",
    ),
}


@pytest.mark.parametrize("failure_point", list(_FAILURE_POINTS))
async def test_publish_is_atomic_whichever_statement_fails(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any], failure_point: str
) -> None:
    document_id = await _draft(api, acme)
    # An ACL already exists so that the DELETE of the old ACL really deletes a row.
    assert (await publish(api.client, acme, document_id, 1, 1, read=["old"])).status_code == 202
    await upload(api.client, acme, b"v2", document_id=document_id)  # revision 3
    if failure_point == "delete_acl":
        # The ACL is the version's: a row of version 2's for the DELETE to really delete.
        await conn.execute(
            "INSERT INTO document_version_acl (tenant_id, document_id, version_number,"
            " principal, permission) VALUES ('acme', $1, 2, 'stale', 'READ')",
            uuid.UUID(document_id),
        )
    table, operation, condition = _FAILURE_POINTS[failure_point]
    await conn.execute(
        f"""
        CREATE FUNCTION kb_test_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {condition} THEN
                RAISE EXCEPTION 'injected failure at {failure_point}';
            END IF;
            RETURN COALESCE(NEW, OLD);
        END $$;
        CREATE TRIGGER kb_test_fail BEFORE {operation} ON {table}
            FOR EACH ROW EXECUTE FUNCTION kb_test_fail();
        """
    )
    before = await snapshot(conn)

    response = await publish(api.client, acme, document_id, 2, 3, read=["new"])

    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert "injected" not in response.text  # internals stay in the log
    assert await snapshot(conn) == before
    assert (
        await conn.fetchval("SELECT status FROM document_version WHERE version_number = 2")
        == "DRAFT"
    )

    # Once the fault is gone the same request goes through, exactly once.
    await conn.execute("DROP TRIGGER kb_test_fail ON " + table)
    retried = await publish(api.client, acme, document_id, 2, 3, read=["new"])
    assert retried.status_code == 202, retried.text
    assert await conn.fetchval("SELECT count(*) FROM index_task") == 2
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 4


async def test_stored_content_cannot_be_changed_afterwards(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = uuid.UUID(await _draft(api, acme))
    for change in (
        "content = 'tampered'::bytea",
        "sha256 = sha256('tampered'::bytea)",
        "media_type = 'text/html'",
        "version_number = 7",
    ):
        with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="immutable"):
            await conn.execute(
                f"UPDATE document_version SET {change} WHERE document_id = $1", document_id
            )
    assert (await publish(api.client, acme, document_id, 1, 1)).status_code == 202
    with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="immutable"):
        await conn.execute(
            "UPDATE document_version SET status = 'DRAFT' WHERE document_id = $1", document_id
        )


async def test_released_connections_are_not_reset_and_hold_no_transaction(
    settings: RuntimeSettings, acme: ApiTenant
) -> None:
    # The publisher's pool skips asyncpg's session reset on release (one round trip less per
    # request, the API key check included): what it relies on is that every publish ends its
    # transaction and takes only transaction-scoped locks -- a refused one too.
    sent: list[str] = []

    async def init(conn: asyncpg.Connection[Any]) -> None:
        await _init_connection(conn)
        conn.add_query_logger(lambda record: sent.append(record.query))

    async with publisher_harness(settings, pool_size=2, init=init) as api:
        document_id = await _draft(api, acme)
        assert (await publish(api.client, acme, document_id, 1, 1)).status_code == 202
        assert (await publish(api.client, acme, document_id, 1, 1)).status_code == 202
        stale = await publish(api.client, acme, document_id, 1, 1, read=["other"])
        assert stale.status_code == 409, stale.text
        assert sent
        assert not [s for s in sent if "RESET ALL" in s or "UNLISTEN" in s]
        held = [await api.pool.acquire() for _ in range(api.pool.get_size())]
        try:
            for conn in held:
                assert not conn.is_in_transaction()
                advisory = await conn.fetchval(
                    "SELECT count(*) FROM pg_locks"
                    " WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
                )
                assert advisory == 0
        finally:
            for conn in held:
                await api.pool.release(conn)
