"""The bulk endpoint's edges (issue 41): an ``items`` part nested too deep or not UTF-8, a
``file`` part without a filename, and a new version whose publish fails half-way. Each is
refused with a problem+json 4xx (or the item refused) and leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from services.runtime.messaging.outbox import aggregate_key
from tests.security.world import Caller, World
from tests.support.api import snapshot
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.stack import connected

pytestmark = pytest.mark.integration

READ = {"read": ["group:support"]}
# services/runtime/messaging/outbox.sql: the seed of the outbox's per-document lock.
OUTBOX_LOCK_SEED = 4_206_902_611


@pytest.fixture
async def conn(module_database: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    async with connected(module_database) as connection:
        yield connection


def publisher(world: World) -> Caller:
    return world.acme.caller("publish")


async def bulk(world: World, items: str | bytes, files: list[tuple[str, Any]]) -> httpx.Response:
    caller = publisher(world)
    parts: list[tuple[str, Any]] = [("items", (None, items, "application/json")), *files]
    return await world.client.post(
        caller.path("/documents/bulk"), files=parts, headers=caller.headers
    )


def a_file(name: str = "a.txt", content: bytes = b"refund text") -> tuple[str, Any]:
    return ("file", (name, content, "text/plain"))


def assert_refused(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    assert problem["errorCode"] == "BULK_INVALID"
    return problem


@pytest.mark.parametrize("depth", [100, 1000, 100_000])
async def test_deeply_nested_items_are_refused_not_a_500(
    world: World, conn: asyncpg.Connection[Any], depth: int
) -> None:
    before = await snapshot(conn)
    response = await bulk(world, "[" * depth + "]" * depth, [a_file()])
    assert_refused(response)
    assert await snapshot(conn) == before


async def test_a_deep_value_inside_an_item_is_refused(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    before = await snapshot(conn)
    deep = "[" * 1000 + "]" * 1000
    items = f'[{{"title": {deep}, "acl": {{"read": ["group:support"]}}}}]'
    assert_refused(await bulk(world, items, [a_file()]))
    assert await snapshot(conn) == before


@pytest.mark.parametrize(
    "items",
    [
        b'[{"title": "\xff\xfe", "acl": {"read": ["group:support"]}}]',
        b'[{"title": "caf\xe9", "acl": {"read": ["group:support"]}}]',  # Latin-1, not UTF-8
        b'[{"title": "ok", "acl": {"read": ["group:\xc3"]}}]',  # a truncated sequence
        b'[{"title": "\xed\xa0\x80", "acl": {"read": ["group:support"]}}]',  # a surrogate
    ],
)
async def test_items_that_are_not_utf8_are_refused(
    world: World, conn: asyncpg.Connection[Any], items: bytes
) -> None:
    before = await snapshot(conn)
    problem = assert_refused(await bulk(world, items, [a_file()]))
    assert "UTF-8" in problem["detail"]
    assert await snapshot(conn) == before


async def test_utf8_items_keep_their_characters(world: World) -> None:
    title = "Rückerstattung \u00e9t\u00e9 \u65e5\u672c \U0001f4c4"
    items = json.dumps([{"title": title, "acl": READ}], ensure_ascii=False).encode()
    response = await bulk(world, items, [a_file()])
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert result["status"] == 202, result
    caller = publisher(world)
    status = await world.client.get(
        caller.path(f"/documents/{result['documentId']}"), headers=caller.headers
    )
    assert status.json()["title"] == title


@pytest.mark.parametrize("content", [b"no name", b"\x89PNG\r\n\x1a\n\xff binary"])
async def test_a_file_part_without_a_filename_is_named_as_such(
    world: World, conn: asyncpg.Connection[Any], content: bytes
) -> None:
    before = await snapshot(conn)
    items = json.dumps([{"title": "A", "acl": READ}, {"title": "B", "acl": READ}])
    response = await bulk(world, items, [a_file(), ("file", (None, content, "text/plain"))])
    problem = assert_refused(response)
    assert "filename" in problem["detail"]
    assert "file part 1" in problem["detail"]
    assert await snapshot(conn) == before


async def test_a_new_version_whose_publish_fails_leaves_no_draft(
    world: World, conn: asyncpg.Connection[Any], module_database: str
) -> None:
    """The item's publish is made to fail after its version is written: its statement
    waits on the document's outbox lock, held here, and is cancelled. The item is refused;
    the document must be as it was (no DRAFT version 2, the same revision)."""
    created = await bulk(world, json.dumps([{"title": "Versioned", "acl": READ}]), [a_file()])
    document_id = created.json()["results"][0]["documentId"]
    rows = "SELECT version_number, status FROM document_version WHERE document_id = $1"
    document = "SELECT revision, latest_version FROM document WHERE document_id = $1"
    versions_before = await conn.fetch(rows, uuid.UUID(document_id))
    document_before = await conn.fetchrow(document, uuid.UUID(document_id))

    holder = await asyncpg.connect(module_database)
    try:
        async with holder.transaction():
            await holder.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, $2))",
                aggregate_key("acme", uuid.UUID(document_id)),
                OUTBOX_LOCK_SEED,
            )
            request = asyncio.create_task(
                bulk(world, json.dumps([{"documentId": document_id, "acl": READ}]), [a_file()])
            )
            await wait_until_blocked_on_a_lock(conn)
            cancelled = await conn.fetchval(
                "SELECT count(*) FROM (SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock') AS c"
            )
            assert cancelled == 1
            response = await request
    finally:
        await holder.close()

    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert result["status"] == 503, result
    assert await conn.fetch(rows, uuid.UUID(document_id)) == versions_before
    assert await conn.fetchrow(document, uuid.UUID(document_id)) == document_before

    # The item can simply be sent again.
    again = await bulk(world, json.dumps([{"documentId": document_id, "acl": READ}]), [a_file()])
    (result,) = again.json()["results"]
    assert (result["status"], result["versionNumber"]) == (202, 2), result
