"""Erase items in the bulk call (docs/architecture.md#document-lifecycle), on real
PostgreSQL: each is what POST .../documents/{d}/erase does and answers (its audit row names
the request's key); an erase item needs an `admin` key and, with another, is refused on its
own (403 KEY_SCOPE_INSUFFICIENT, nothing of it written) while the other items go on, as
every per-item rule of the bulk call is; an unreadable erase item refuses the request."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.publisher.keys.store_pg import KeySpec, PgKeyStore
from services.runtime.auth.keys import Scope
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from tests.integration.test_document_delete import published
from tests.support.api import ApiTenant, Harness, add_tenant, publisher_harness

pytestmark = pytest.mark.integration

NEW = {"title": "New", "acl": {"read": ["group:all"]}}


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[Harness]:
    async with publisher_harness(settings) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")  # its first key is an admin key


async def bulk(
    api: Harness, tenant: ApiTenant, items: list[Any], files: list[bytes], key: str | None = None
) -> Any:
    parts: list[Any] = [("items", (None, json.dumps(items).encode(), "application/json"))]
    parts += [("file", (f"f{n}.txt", content, "text/plain")) for n, content in enumerate(files)]
    headers = tenant.headers if key is None else {"Authorization": f"Bearer {key}"}
    return await api.client.post(tenant.path("/documents/bulk"), files=parts, headers=headers)


async def content_left(conn: asyncpg.Connection[Any], document_id: str) -> int:
    """Versions with bytes and version ACL rows the document still has."""
    doc = uuid.UUID(document_id)
    bytes_left = await conn.fetchval(
        "SELECT count(*) FROM document_version WHERE document_id = $1 AND content <> ''", doc
    )
    acl_left = await conn.fetchval(
        "SELECT count(*) FROM document_version_acl WHERE document_id = $1", doc
    )
    return int(bytes_left) + int(acl_left)


async def test_bulk_erase_items_answer_like_the_single_erase(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    live_id, _ = await published(api, acme)
    deleted_id, deleted_revision = await published(api, acme)
    kept_id, _ = await published(api, acme)
    response = await bulk(
        api,
        acme,
        [
            {"documentId": live_id, "erase": True},
            NEW,
            {"documentId": deleted_id, "delete": True, "revision": deleted_revision},
            {"documentId": str(uuid.uuid4()), "erase": True},
        ],
        [b"A new document."],
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["published"], body["deleted"], body["erased"], body["refused"]) == (1, 1, 1, 1)
    erased = body["results"][0]
    assert erased["status"] == 200
    assert erased["documentId"] == live_id
    for field in ("deletedAt", "requestedAt", "erasedAt"):
        assert erased[field] is not None, field
    assert (body["results"][3]["status"], body["results"][3]["errorCode"]) == (
        404,
        "DOCUMENT_NOT_FOUND",
    )
    assert await content_left(conn, live_id) == 0
    assert await content_left(conn, kept_id) > 0
    audit = await conn.fetchrow(
        "SELECT key_id, requested_by, erased_at FROM document_erasure WHERE document_id = $1",
        uuid.UUID(live_id),
    )
    assert audit is not None
    assert audit["requested_by"] == "api"
    assert audit["key_id"] is not None
    assert audit["erased_at"] is not None

    # The single erase's answer to a repeat: what the erase did, nothing written.
    single = await api.client.post(acme.path(f"/documents/{live_id}/erase"), headers=acme.headers)
    assert single.status_code == 200, single.text
    again = await bulk(api, acme, [{"documentId": live_id, "erase": True}], [])
    assert again.status_code == 200, again.text
    repeated = again.json()["results"][0]
    for field in ("deletedAt", "requestedAt", "erasedAt"):
        assert repeated[field] == single.json()[field] == erased[field], field


async def test_an_erase_item_needs_an_admin_key_and_is_refused_alone(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id, _ = await published(api, acme)
    key = new_api_key("acme")
    await PgKeyStore(conn).create_key(
        "acme", hash_api_key(key), KeySpec(frozenset({Scope.PUBLISH}))
    )
    response = await bulk(
        api, acme, [{"documentId": document_id, "erase": True}, NEW], [b"New."], key=key
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["published"], body["erased"], body["refused"]) == (1, 0, 1)
    refused = body["results"][0]
    assert (refused["status"], refused["errorCode"]) == (403, "KEY_SCOPE_INSUFFICIENT")
    assert body["results"][1]["status"] == 202
    # Nothing of the refused item was written: not deleted, not erased, no audit row.
    assert await conn.fetchval("SELECT count(*) FROM document WHERE deleted_at IS NOT NULL") == 0
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 0
    assert await content_left(conn, document_id) > 0


@pytest.mark.parametrize(
    "item",
    [
        {"erase": True},
        {"documentId": "00000000-0000-0000-0000-000000000001", "erase": True, "revision": 1},
        {"documentId": "00000000-0000-0000-0000-000000000001", "erase": True, "delete": True},
        {
            "documentId": "00000000-0000-0000-0000-000000000001",
            "erase": True,
            "acl": {"read": []},
        },
        {"documentId": "00000000-0000-0000-0000-000000000001", "erase": True, "title": "T"},
    ],
)
async def test_an_unreadable_erase_item_refuses_the_request(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any], item: dict[str, Any]
) -> None:
    document_id, _ = await published(api, acme)
    response = await bulk(api, acme, [item, {"documentId": document_id, "erase": True}], [])
    assert response.status_code == 400, response.text
    assert response.json()["errorCode"] == "BULK_INVALID"
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 0


async def test_an_erase_item_takes_no_file(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id, _ = await published(api, acme)
    response = await bulk(api, acme, [{"documentId": document_id, "erase": True}], [b"a file"])
    assert response.status_code == 400, response.text
    assert response.json()["errorCode"] == "BULK_INVALID"
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 0
