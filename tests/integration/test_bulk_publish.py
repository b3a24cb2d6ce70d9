"""Bulk publishing over the real API and PostgreSQL: every item leaves what the single calls
leave (version, ACL, task, the same events), a bad item is refused on its own with its
code, and a request that cannot be read changes nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from services.runtime.messaging.avro import default_registry
from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, Harness, add_tenant, publish, publisher_harness, snapshot
from tests.support.api import upload as single_upload
from tests.support.documents import SAMPLE, make_docx, make_html, make_pdf

pytestmark = pytest.mark.integration

DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[Harness]:
    async with publisher_harness(settings, max_upload_bytes=64 * 1024) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


async def bulk(
    client: httpx.AsyncClient,
    tenant: ApiTenant,
    items: list[dict[str, Any]],
    files: list[tuple[str, bytes, str]],
) -> httpx.Response:
    parts: list[tuple[str, Any]] = [("items", (None, json.dumps(items), "application/json"))]
    parts += [("file", file) for file in files]
    return await client.post(tenant.path("/documents/bulk"), files=parts, headers=tenant.headers)


async def events_of(conn: asyncpg.Connection[Any], document_id: str) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT event_type, payload FROM outbox WHERE aggregate_key LIKE $1 ORDER BY position",
        f"%/{document_id}",
    )
    registry = default_registry()
    return [{"type": row["event_type"], **registry.decode(row["payload"]).record} for row in rows]


async def test_new_documents_are_published_as_the_single_calls_publish_them(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    texts = [f"Policy {n}: refunds within {n} days.".encode() for n in range(3)]
    response = await bulk(
        api.client,
        acme,
        [{"title": f"Policy {n}", "acl": {"read": ["group:support"]}} for n in range(3)],
        [(f"p{n}.txt", text, "text/plain") for n, text in enumerate(texts)],
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["published"], body["refused"]) == (3, 0)
    results = body["results"]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert {(r["status"], r["versionNumber"], r["revision"]) for r in results} == {(202, 1, 2)}

    # The same document through the single calls, for comparison.
    created = (await single_upload(api.client, acme, b"single")).json()
    published = await publish(
        api.client, acme, created["documentId"], 1, created["revision"], ["group:support"]
    )
    assert published.status_code == 202, published.text
    single_events = await events_of(conn, created["documentId"])

    for result, text in zip(results, texts, strict=True):
        document_id = result["documentId"]
        status = await api.client.get(acme.path(f"/documents/{document_id}"), headers=acme.headers)
        assert status.json()["indexStatus"] == "INDEXING"
        assert status.json()["publishedVersion"] == 1
        version = await conn.fetchrow(
            "SELECT content, status, media_type FROM document_version WHERE document_id = $1",
            uuid.UUID(document_id),
        )
        assert version is not None
        assert (version["content"], version["status"]) == (text, "PUBLISHED")
        acl = await conn.fetch(
            "SELECT principal FROM document_version_acl WHERE document_id = $1",
            uuid.UUID(document_id),
        )
        assert [row["principal"] for row in acl] == ["group:support"]
        task = await conn.fetchrow(
            "SELECT task_id, status, tier FROM index_task WHERE document_id = $1",
            uuid.UUID(document_id),
        )
        assert task is not None
        assert (str(task["task_id"]), task["status"], task["tier"]) == (
            result["indexTaskId"],
            "PENDING",
            "standard",
        )
        events = await events_of(conn, document_id)
        # The same events, in the same order, with the same fields as the single calls'.
        assert [e["type"] for e in events] == [e["type"] for e in single_events]
        assert [sorted(e) for e in events] == [sorted(e) for e in single_events]
        assert events[1]["revision"] == 2
        assert events[1]["readPrincipals"] == ["group:support"]


async def test_a_bad_item_is_refused_alone_with_its_code(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    existing = (await single_upload(api.client, acme, b"v1 text")).json()
    response = await bulk(
        api.client,
        acme,
        [
            {"title": "Good", "acl": {"read": ["group:all"]}},
            {"title": "Binary", "acl": {"read": ["group:all"]}},
            {"title": "Bad principal", "acl": {"read": ["group\u200b:all"]}},
            {"documentId": existing["documentId"], "acl": {"read": ["group:all"]}},
            {"documentId": str(uuid.uuid4()), "acl": {"read": ["group:all"]}},
            {"title": "Empty", "acl": {"read": ["group:all"]}},
        ],
        [
            ("good.txt", b"good text", "text/plain"),
            ("x.bin", b"\x00\x01", "application/octet-stream"),
            ("p.txt", b"text", "text/plain"),
            ("v2.txt", b"v2 text", "text/plain"),
            ("gone.txt", b"text", "text/plain"),
            ("empty.txt", b"", "text/plain"),
        ],
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [(r["status"], r.get("errorCode")) for r in results] == [
        (202, None),
        (415, "UNSUPPORTED_MEDIA_TYPE"),
        (422, "PRINCIPAL_INVALID"),
        (202, None),
        (404, "DOCUMENT_NOT_FOUND"),
        (400, "EMPTY_FILE"),
    ]
    assert results[3]["documentId"] == existing["documentId"]
    assert results[3]["versionNumber"] == 2
    titles = {row["title"] for row in await conn.fetch("SELECT title FROM document")}
    assert titles == {"Good", "Refund policy"}  # the refused new documents left nothing


async def test_an_item_whose_bytes_are_not_its_type_is_refused_alone(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    existing = (await single_upload(api.client, acme, b"v1 text")).json()
    before = await snapshot(conn)
    read = {"read": ["group:all"]}
    response = await bulk(
        api.client,
        acme,
        [
            {"title": "HTML as PDF", "acl": read},
            {"title": "PDF", "acl": read},
            {"title": "DOCX", "acl": read},
            {"title": "Latin-1 as UTF-8", "acl": read},
            {"documentId": existing["documentId"], "acl": read},
        ],
        [
            ("page.pdf", make_html(), "application/pdf"),
            ("real.pdf", make_pdf(SAMPLE[:1]), "application/pdf"),
            ("real.docx", make_docx(SAMPLE[:1]), DOCX),
            ("cafe.txt", "café".encode("latin-1"), "text/plain"),
            ("v2.pdf", b"<html>not a pdf</html>", "application/pdf"),
        ],
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [(r["status"], r.get("errorCode")) for r in results] == [
        (415, "MEDIA_TYPE_MISMATCH"),
        (202, None),
        (202, None),
        (415, "MEDIA_TYPE_MISMATCH"),
        (415, "MEDIA_TYPE_MISMATCH"),
    ]
    titles = {row["title"] for row in await conn.fetch("SELECT title FROM document")}
    assert titles == {"PDF", "DOCX", "Refund policy"}
    # The refused new version left the existing document as it was.
    after = await snapshot(conn)
    mine = uuid.UUID(existing["documentId"])
    assert [r for r in after["document"] if r[1] == mine] == [
        r for r in before["document"] if r[1] == mine
    ]
    assert len(after["document_version"]) == len(before["document_version"]) + 2


@pytest.mark.parametrize(
    ("items", "files"),
    [
        (None, [("a.txt", b"a", "text/plain")]),  # no items part
        ("not json", [("a.txt", b"a", "text/plain")]),
        ([{"title": "A", "acl": {"read": ["g"]}}], []),  # a file missing
        ([{"acl": {"read": ["g"]}}], [("a.txt", b"a", "text/plain")]),  # neither title nor id
        ([{"title": "A", "acl": {"read": ["g"]}, "extra": 1}], [("a.txt", b"a", "text/plain")]),
    ],
)
async def test_an_unreadable_request_is_refused_whole_and_changes_nothing(
    api: Harness,
    acme: ApiTenant,
    conn: asyncpg.Connection[Any],
    items: Any,
    files: list[tuple[str, bytes, str]],
) -> None:
    before = await snapshot(conn)
    parts: list[tuple[str, Any]] = [("file", file) for file in files]
    if items is not None:
        text = items if isinstance(items, str) else json.dumps(items)
        parts.insert(0, ("items", (None, text, "application/json")))
    response = await api.client.post(
        acme.path("/documents/bulk"), files=parts, headers=acme.headers
    )
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["errorCode"] == "BULK_INVALID"
    assert await snapshot(conn) == before


async def test_another_tenants_key_is_refused(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    globex = await add_tenant(conn, "globex", "standard")
    before = await snapshot(conn)
    response = await api.client.post(
        acme.path("/documents/bulk"),
        files=[
            ("items", (None, json.dumps([{"title": "A", "acl": {"read": ["g"]}}]), "text/plain")),
            ("file", ("a.txt", b"a", "text/plain")),
        ],
        headers=globex.headers,
    )
    assert response.status_code == 403, response.text
    assert await snapshot(conn) == before
