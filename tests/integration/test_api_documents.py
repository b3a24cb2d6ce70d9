"""Publisher HTTP API over a real PostgreSQL: uploads, status, index tasks, auth, errors."""

from __future__ import annotations

import hashlib
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest

from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgPublisherStore
from services.publisher.web.api import PublisherStores, create_app
from services.runtime.pg.db import create_pool
from services.runtime.settings import RuntimeSettings
from tests.support.api import (
    BASE_URL,
    ApiTenant,
    Harness,
    add_tenant,
    live_publisher,
    publish,
    publisher_harness,
    snapshot,
    upload,
)
from tests.support.documents import SAMPLE, make_docx, make_html, make_pdf, make_zip_not_docx

pytestmark = pytest.mark.integration

MAX_UPLOAD = 64 * 1024
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[Harness]:
    async with publisher_harness(settings, max_upload_bytes=MAX_UPLOAD) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


@pytest.fixture
async def globex(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "globex", "premium")


def _problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["errorCode"] == code, body
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    assert body["type"]
    return body


# --- uploads -------------------------------------------------------------------------------------


async def test_upload_stores_an_immutable_draft_with_its_digest(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    content = b"# Refunds\n\nWithin 30 days."
    response = await upload(
        api.client, acme, content, media_type="text/markdown", filename="refunds.md"
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body == {"documentId": body["documentId"], "versionNumber": 1, "revision": 1}
    row = await conn.fetchrow(
        "SELECT * FROM document_version WHERE tenant_id = 'acme' AND document_id = $1",
        uuid.UUID(body["documentId"]),
    )
    assert row is not None
    assert row["content"] == content
    assert row["sha256"] == hashlib.sha256(content).digest()
    assert row["size_bytes"] == len(content)
    assert row["media_type"] == "text/markdown"
    assert row["status"] == "DRAFT"


async def test_a_new_version_bumps_latest_version_and_revision(
    api: Harness, acme: ApiTenant
) -> None:
    created = (await upload(api.client, acme)).json()
    second = await upload(api.client, acme, b"v2 text", document_id=created["documentId"])
    assert second.status_code == 201, second.text
    assert second.json() == {
        "documentId": created["documentId"],
        "versionNumber": 2,
        "revision": 2,
    }
    status = (
        await api.client.get(acme.path(f"/documents/{created['documentId']}"), headers=acme.headers)
    ).json()
    assert status["latestVersion"] == 2
    assert status["revision"] == 2
    assert status["indexStatus"] == "NOT_PUBLISHED"
    assert status["publishedVersion"] is None


@pytest.mark.parametrize(
    ("media_type", "filename", "stored", "content"),
    [
        ("text/plain; charset=utf-8", "a.txt", "text/plain", "Grüße".encode()),
        ("text/plain; charset=utf-16", "a.txt", "text/plain", "Grüße".encode("utf-16")),
        ("text/html", "a.html", "text/html", make_html(SAMPLE[:1])),
        ("application/pdf", "a.pdf", "application/pdf", make_pdf(SAMPLE[:1])),
        (DOCX, "a.docx", DOCX, make_docx(SAMPLE[:1])),
        ("application/octet-stream", "notes.md", "text/markdown", b"# Notes"),
    ],
)
async def test_every_media_type_the_indexer_parses_is_accepted(
    api: Harness,
    acme: ApiTenant,
    conn: asyncpg.Connection[Any],
    media_type: str,
    filename: str,
    stored: str,
    content: bytes,
) -> None:
    response = await upload(api.client, acme, content, media_type=media_type, filename=filename)
    assert response.status_code == 201, response.text
    assert (
        await conn.fetchval(
            "SELECT media_type FROM document_version WHERE document_id = $1",
            uuid.UUID(response.json()["documentId"]),
        )
        == stored
    )


# --- bad input: a clean 4xx and nothing changed --------------------------------------------------


@pytest.mark.parametrize(
    ("content", "media_type", "filename"),
    [
        (make_html(SAMPLE[:1]), "application/pdf", "page.pdf"),  # HTML stored as a PDF
        (make_pdf(SAMPLE[:1]), DOCX, "a.docx"),
        (make_zip_not_docx(), DOCX, "a.docx"),
        (b"caf\xe9", "text/plain", "a.txt"),  # Latin-1 without a declared charset
        (b"<p>caf\xe9</p>", "text/html", "a.html"),
        (make_html(SAMPLE[:1]), "application/octet-stream", "looks.pdf"),  # by extension
    ],
)
async def test_bytes_that_are_not_their_type_are_415_and_change_nothing(
    api: Harness,
    acme: ApiTenant,
    conn: asyncpg.Connection[Any],
    content: bytes,
    media_type: str,
    filename: str,
) -> None:
    existing = (await upload(api.client, acme)).json()["documentId"]
    before = await snapshot(conn)
    for response in [
        await upload(api.client, acme, content, media_type=media_type, filename=filename),
        await upload(
            api.client,
            acme,
            content,
            media_type=media_type,
            filename=filename,
            document_id=existing,
        ),
    ]:
        _problem(response, 415, "MEDIA_TYPE_MISMATCH")
    assert await snapshot(conn) == before


async def test_bad_uploads_are_refused_and_change_nothing(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    existing = (await upload(api.client, acme)).json()["documentId"]
    before = await snapshot(conn)
    cases = [
        (await upload(api.client, acme, b""), 400, "EMPTY_FILE"),
        (await upload(api.client, acme, b"", document_id=existing), 400, "EMPTY_FILE"),
        (
            await upload(api.client, acme, b"GIF89a", media_type="image/gif", filename="x.gif"),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            await upload(
                api.client, acme, b"\x00", media_type="application/octet-stream", filename="x.bin"
            ),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        # One byte over the limit: counted after parsing.
        (await upload(api.client, acme, b"x" * (MAX_UPLOAD + 1)), 413, "PAYLOAD_TOO_LARGE"),
        # Far over: refused by Content-Length before the body is read.
        (await upload(api.client, acme, b"x" * (MAX_UPLOAD * 4)), 413, "PAYLOAD_TOO_LARGE"),
        (await upload(api.client, acme, title=None), 422, "VALIDATION_FAILED"),
        (await upload(api.client, acme, title="   "), 422, "TITLE_INVALID"),
        (await upload(api.client, acme, title="x" * 501), 422, "VALIDATION_FAILED"),
        (
            await api.client.post(
                acme.path("/documents"), data={"title": "no file"}, headers=acme.headers
            ),
            422,
            "VALIDATION_FAILED",
        ),
        (
            await upload(api.client, acme, b"x", document_id=uuid.uuid4()),
            404,
            "DOCUMENT_NOT_FOUND",
        ),
        (await upload(api.client, acme, b"x", document_id="not-a-uuid"), 422, "VALIDATION_FAILED"),
    ]
    for response, status, code in cases:
        _problem(response, status, code)
    assert await snapshot(conn) == before


async def test_chunked_body_over_the_limit_is_refused_while_streaming(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    before = await snapshot(conn)
    boundary = "kbboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="title"\r\n\r\nBig\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n'
        "Content-Type: text/plain\r\n\r\n"
    ).encode()

    async def body() -> AsyncIterator[bytes]:
        yield head
        for _ in range(5):
            yield b"x" * (MAX_UPLOAD // 2)
        yield f"\r\n--{boundary}--\r\n".encode()

    response = await api.client.post(
        acme.path("/documents"),
        content=body(),
        headers={**acme.headers, "Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert "content-length" not in response.request.headers  # counted while streaming
    _problem(response, 413, "PAYLOAD_TOO_LARGE")
    assert await snapshot(conn) == before


async def test_malformed_and_unknown_json_and_out_of_range_numbers_are_4xx(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = (await upload(api.client, acme)).json()["documentId"]
    publish_path = acme.path(f"/documents/{document_id}/versions/1/publish")
    before = await snapshot(conn)
    headers = {**acme.headers, "Content-Type": "application/json"}
    good_acl = {"read": ["group:all"]}
    cases = [
        (await api.client.post(publish_path, content=b"{not json", headers=headers), 400),
        (await api.client.post(publish_path, content=b"", headers=headers), 422),
        (await api.client.post(publish_path, json=[1, 2], headers=acme.headers), 422),
        (
            await api.client.post(
                publish_path,
                json={"revision": 1, "acl": good_acl, "force": True},
                headers=acme.headers,
            ),
            422,
        ),
        (
            await api.client.post(
                publish_path,
                json={"revision": 1, "acl": {"read": [], "write": ["x"]}},
                headers=acme.headers,
            ),
            422,
        ),
        (
            await api.client.post(
                publish_path, json={"revision": "1", "acl": good_acl}, headers=acme.headers
            ),
            422,
        ),
        (
            await api.client.post(
                publish_path, json={"revision": -1, "acl": good_acl}, headers=acme.headers
            ),
            422,
        ),
        (
            await api.client.post(
                publish_path, json={"revision": 2**70, "acl": good_acl}, headers=acme.headers
            ),
            422,
        ),
        (
            await api.client.post(
                publish_path, json={"revision": 1, "acl": {"read": [""]}}, headers=acme.headers
            ),
            422,
        ),
        (
            await api.client.post(
                publish_path,
                json={"revision": 1, "acl": {"read": ["x" * 201]}},
                headers=acme.headers,
            ),
            422,
        ),
        (await publish(api.client, acme, document_id, -1, 1), 422),
        (await publish(api.client, acme, document_id, 0, 1), 422),
        (await publish(api.client, acme, document_id, 2**31, 1), 422),
        (await publish(api.client, acme, document_id, 99, 1), 404),
        (await publish(api.client, acme, uuid.uuid4(), 1, 1), 404),
        (await publish(api.client, acme, "x" * 40, 1, 1), 422),
        (await api.client.get(acme.path("/documents/not-a-uuid"), headers=acme.headers), 422),
        (await api.client.get(acme.path("/index-tasks/123"), headers=acme.headers), 422),
        (
            await api.client.get(acme.path(f"/index-tasks/{uuid.uuid4()}"), headers=acme.headers),
            404,
        ),
    ]
    for response, status in cases:
        assert response.status_code == status, (response.request.url, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["errorCode"]
    malformed = cases[0][0].json()
    assert malformed["errorCode"] == "MALFORMED_JSON"
    assert cases[3][0].json()["errors"][0]["type"] == "extra_forbidden"
    assert await snapshot(conn) == before


async def test_framework_errors_are_problems_too(api: Harness, acme: ApiTenant) -> None:
    _problem(await api.client.get("/nowhere"), 404, "ROUTE_NOT_FOUND")
    response = await api.client.delete("/healthz")
    _problem(response, 405, "METHOD_NOT_ALLOWED")
    assert "GET" in response.headers["allow"]
    # Unknown routes under a tenant are still authenticated first, then 404.
    _problem(await api.client.get(acme.path("/nowhere")), 401, "UNAUTHENTICATED")
    _problem(
        await api.client.get(acme.path("/nowhere"), headers=acme.headers), 404, "ROUTE_NOT_FOUND"
    )


# --- auth and tenant isolation -------------------------------------------------------------------


async def test_every_tenant_call_needs_that_tenants_key(
    api: Harness, acme: ApiTenant, globex: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = (await upload(api.client, globex)).json()["documentId"]
    before = await snapshot(conn)
    paths = [
        ("GET", f"/documents/{document_id}"),
        ("GET", f"/index-tasks/{uuid.uuid4()}"),
        ("POST", "/documents"),
        ("POST", f"/documents/{document_id}/versions"),
        ("POST", f"/documents/{document_id}/versions/1/publish"),
    ]
    wrong_keys: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic Zm9vOmJhcg=="},
        {"Authorization": "Bearer not-a-key"},
        # Well-formed, right tenant, wrong secret.
        {"Authorization": f"Bearer kb.globex.{'A' * 43}"},
        # Malformed body too: authentication still comes first.
        {"Authorization": "Bearer nope", "Content-Type": "application/json"},
    ]
    for method, rest in paths:
        for headers in wrong_keys:
            response = await api.client.request(
                method, globex.path(rest), headers=headers, content=b"{bad"
            )
            _problem(response, 401, "UNAUTHENTICATED")
            assert response.headers["www-authenticate"] == "Bearer"
        # A valid key of another tenant.
        response = await api.client.request(
            method, globex.path(rest), headers=acme.headers, content=b"{bad"
        )
        _problem(response, 403, "FORBIDDEN")
    assert await snapshot(conn) == before


async def test_a_proxy_path_prefix_does_not_bypass_authentication(
    api: Harness, globex: ApiTenant, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    """Behind a reverse proxy that mounts the API under a prefix (uvicorn --root-path), the
    ASGI path carries the prefix: the key check must still apply, and fail closed."""
    document_id = (await upload(api.client, globex)).json()["documentId"]
    before = await snapshot(conn)
    transport = httpx.ASGITransport(app=api.app, root_path="/kb")
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as prefixed:
        anonymous = await prefixed.get(f"/kb{globex.path(f'/documents/{document_id}')}")
        _problem(anonymous, 401, "UNAUTHENTICATED")
        created = await prefixed.post(
            f"/kb{globex.path('/documents')}",
            files={"file": ("a.txt", b"hello", "text/plain")},
            data={"title": "sneaky"},
        )
        _problem(created, 401, "UNAUTHENTICATED")
        other = await prefixed.get(
            f"/kb{globex.path(f'/documents/{document_id}')}", headers=acme.headers
        )
        _problem(other, 403, "FORBIDDEN")
        allowed = await prefixed.get(
            f"/kb{globex.path(f'/documents/{document_id}')}", headers=globex.headers
        )
        assert allowed.status_code == 200, allowed.text
    assert await snapshot(conn) == before


async def test_a_guessed_document_id_of_another_tenant_is_not_found(
    api: Harness, acme: ApiTenant, globex: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    theirs = (await upload(api.client, globex, b"globex secret", title="Globex only")).json()
    published = await publish(api.client, globex, theirs["documentId"], 1, theirs["revision"])
    task_id = published.json()["indexTaskId"]
    before = await snapshot(conn)

    for response in [
        await api.client.get(acme.path(f"/documents/{theirs['documentId']}"), headers=acme.headers),
        await api.client.get(acme.path(f"/index-tasks/{task_id}"), headers=acme.headers),
        await upload(api.client, acme, b"overwrite?", document_id=theirs["documentId"]),
        await publish(api.client, acme, theirs["documentId"], 1, 2),
    ]:
        problem = _problem(response, 404, response.json()["errorCode"])
        assert problem["errorCode"] in {"DOCUMENT_NOT_FOUND", "INDEX_TASK_NOT_FOUND"}
        assert "Globex" not in response.text
        assert "globex secret" not in response.text
    assert await snapshot(conn) == before


# --- status and index task -----------------------------------------------------------------------


async def test_status_follows_the_task_and_the_search_pointer(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    created = (await upload(api.client, acme, title="Refund policy")).json()
    document_id = created["documentId"]
    status_path = acme.path(f"/documents/{document_id}")

    published = (await publish(api.client, acme, document_id, 1, 1)).json()
    status = (await api.client.get(status_path, headers=acme.headers)).json()
    assert status["indexStatus"] == "INDEXING"
    assert status["title"] == "Refund policy"
    assert status["publishedVersion"] == 1
    assert status["searchVersion"] is None
    assert status["indexTaskId"] == published["indexTaskId"]
    assert status["failure"] is None
    assert status["searchLagSince"] == status["publishedAt"]

    # The indexer's sink (simulated): v1 becomes searchable.
    await conn.execute(
        """
        INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                             embedding_model, task_id)
        VALUES ('acme', $1, 1, 'local-hash-256', $2)
        """,
        uuid.UUID(document_id),
        uuid.UUID(published["indexTaskId"]),
    )
    await conn.execute(
        "UPDATE index_task SET status = 'SUCCEEDED', finished_at = now() WHERE task_id = $1",
        uuid.UUID(published["indexTaskId"]),
    )
    status = (await api.client.get(status_path, headers=acme.headers)).json()
    assert status["indexStatus"] == "SEARCHABLE"
    assert status["searchVersion"] == 1
    assert status["searchLagSince"] is None

    # v2 is published but its task dies: FAILED with the code, v1 still searchable.
    await upload(
        api.client,
        acme,
        b"%PDF-broken",
        media_type="application/pdf",
        filename="broken.pdf",
        document_id=document_id,
    )
    v2 = (await publish(api.client, acme, document_id, 2, 3)).json()
    await conn.execute(
        """
        UPDATE index_task SET status = 'DEAD', error_code = 'DOCUMENT_PARSE_FAILED',
               error_message = 'not a PDF', attempts = 1, finished_at = now()
         WHERE task_id = $1
        """,
        uuid.UUID(v2["indexTaskId"]),
    )
    status = (await api.client.get(status_path, headers=acme.headers)).json()
    assert status["indexStatus"] == "FAILED"
    assert status["failure"]["errorCode"] == "DOCUMENT_PARSE_FAILED"
    # The stored text is for operators: the tenant gets the code's fixed text.
    assert status["failure"]["message"] == "The document could not be parsed."
    assert status["publishedVersion"] == 2
    assert status["searchVersion"] == 1
    assert status["indexTaskId"] == v2["indexTaskId"]
    assert datetime.fromisoformat(status["searchLagSince"]) <= datetime.now(UTC)


async def test_index_task_is_returned_in_camel_case(api: Harness, acme: ApiTenant) -> None:
    created = (await upload(api.client, acme)).json()
    task_id = (await publish(api.client, acme, created["documentId"], 1, 1)).json()["indexTaskId"]
    response = await api.client.get(acme.path(f"/index-tasks/{task_id}"), headers=acme.headers)
    assert response.status_code == 200, response.text
    task = response.json()
    assert task["taskId"] == task_id
    assert task["documentId"] == created["documentId"]
    assert task["versionNumber"] == 1
    assert task["taskType"] == "INDEX_VERSION"
    assert task["tier"] == "standard"
    assert task["status"] == "PENDING"
    assert task["attempts"] == 0
    assert "leaseOwner" not in task
    assert {"nextAttemptAt", "createdAt", "updatedAt", "errorCode", "maxAttempts"} <= set(task)


# --- operations ----------------------------------------------------------------------------------


async def test_health_readiness_and_metrics(api: Harness, acme: ApiTenant) -> None:
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    ready = await api.client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready"}

    created = (await upload(api.client, acme)).json()
    await publish(api.client, acme, created["documentId"], 1, 1)
    await publish(api.client, acme, created["documentId"], 1, 1)
    await publish(api.client, acme, created["documentId"], 1, 1, read=["someone-else"])
    await api.client.get(acme.path("/documents/x"))

    text = (await api.client.get("/metrics")).text
    assert 'kb_publisher_operations_total{operation="publish",result="ok"} 1.0' in text
    assert 'kb_publisher_operations_total{operation="publish",result="unchanged"} 1.0' in text
    assert (
        'kb_publisher_operations_total{operation="publish",result="REVISION_CONFLICT"} 1.0' in text
    )
    assert (
        'route="/v1/tenants/{tenantId}/documents/{documentId}/versions/{versionNumber}/publish"'
        in text
    )
    assert 'route="<unmatched>",status="401"' in text
    # Never an id in a label.
    assert created["documentId"] not in text
    assert "acme" not in text


async def test_readiness_fails_while_a_migration_is_pending(
    api: Harness, conn: asyncpg.Connection[Any]
) -> None:
    last = await conn.fetchval("SELECT max(version) FROM schema_migration")
    await conn.execute("DELETE FROM schema_migration WHERE version = $1", last)
    _problem(await api.client.get("/readyz"), 503, "NOT_READY")


async def test_a_request_that_cannot_get_a_connection_answers_503_quickly(
    settings: RuntimeSettings, acme: ApiTenant
) -> None:
    """With every pool connection busy (or the database hanging), requests give up after
    the acquire timeout with a retriable 503 instead of piling up."""
    publisher_settings = PublisherSettings(
        database_url=settings.database_url, db_pool_min_size=1, db_pool_max_size=1
    )
    pool = await create_pool(publisher_settings)
    try:
        app = create_app(
            publisher_settings,
            stores=PublisherStores(PgPublisherStore(pool, acquire_timeout_seconds=0.2)),
        )
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client,
            pool.acquire(),
        ):
            response = await client.get(
                acme.path(f"/documents/{uuid.uuid4()}"), headers=acme.headers
            )
        _problem(response, 503, "DATABASE_UNAVAILABLE")
        assert response.headers["retry-after"] == "1"
    finally:
        await pool.close()


# --- hardening -----------------------------------------------------------------------------------


async def test_hidden_characters_in_titles_and_principals_are_422_and_change_nothing(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = (await upload(api.client, acme)).json()["documentId"]
    before = await snapshot(conn)
    for title in ["Refund\u202epolicy", "Refund\u200bpolicy", "Refund\x1bpolicy", "\ufeffRefund"]:
        _problem(await upload(api.client, acme, title=title), 422, "TITLE_INVALID")
    for principal in ["group:\u200dadmins", "group:admins\u2066", "group:\x00admins"]:
        response = await publish(api.client, acme, document_id, 1, 1, read=[principal])
        _problem(response, 422, "PRINCIPAL_INVALID")
    assert await snapshot(conn) == before

    # Two spellings of one principal are one principal: publishing again is a repeat.
    first = await publish(api.client, acme, document_id, 1, 1, read=["user:Ren\u00e9e"])
    assert first.status_code == 202, first.text
    again = await publish(api.client, acme, document_id, 1, 1, read=["user:Rene\u0301e"])
    assert again.status_code == 202, again.text
    assert again.json() == first.json()
    assert await conn.fetchval("SELECT array_agg(principal) FROM document_version_acl") == [
        "user:Ren\u00e9e"
    ]
    decomposed = await upload(api.client, acme, title="Cafe\u0301")
    status = await api.client.get(
        acme.path(f"/documents/{decomposed.json()['documentId']}"), headers=acme.headers
    )
    assert status.json()["title"] == "Caf\u00e9"


async def test_a_publish_body_above_the_json_limit_is_413_and_changes_nothing(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = (await upload(api.client, acme)).json()["documentId"]
    before = await snapshot(conn)
    principals = [f"group:{i:04d}-{'x' * 150}" for i in range(200)]  # ~32 KiB of JSON
    _problem(
        await publish(api.client, acme, document_id, 1, 1, read=principals),
        413,
        ("PAYLOAD_TOO_LARGE"),
    )
    assert await snapshot(conn) == before


async def test_tenants_see_no_lease_owner_and_no_stored_error_text(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    created = (await upload(api.client, acme)).json()
    task_id = (await publish(api.client, acme, created["documentId"], 1, 1)).json()["indexTaskId"]
    await conn.execute(
        """
        UPDATE index_task SET status = 'DEAD', error_code = 'INTERNAL_ERROR',
               error_message = 'UniqueViolationError: duplicate key value violates kc_pkey',
               lease_owner = 'indexer-3.internal:4242:9f1c', attempts = 1, finished_at = now()
         WHERE task_id = $1
        """,
        uuid.UUID(task_id),
    )
    task = await api.client.get(acme.path(f"/index-tasks/{task_id}"), headers=acme.headers)
    status = await api.client.get(
        acme.path(f"/documents/{created['documentId']}"), headers=acme.headers
    )
    for response in (task, status):
        assert response.status_code == 200, response.text
        assert "indexer-3" not in response.text
        assert "kc_pkey" not in response.text
        assert "leaseOwner" not in response.text
    assert task.json()["errorCode"] == "INTERNAL_ERROR"
    assert task.json()["errorMessage"] == "Indexing failed; an operator can see the details."
    assert status.json()["failure"]["message"] == task.json()["errorMessage"]


async def test_readiness_names_no_migration(api: Harness, conn: asyncpg.Connection[Any]) -> None:
    last = await conn.fetchrow("SELECT version, name FROM schema_migration ORDER BY 1 DESC")
    assert last is not None
    await conn.execute("DELETE FROM schema_migration WHERE version = $1", last["version"])
    response = await api.client.get("/readyz")
    body = _problem(response, 503, "NOT_READY")
    assert last["name"] not in response.text
    assert "migration" not in body["detail"]


async def test_a_request_head_that_never_completes_is_cut_off(settings: RuntimeSettings) -> None:
    """A client trickling its request line and headers (slowloris) loses its connection
    once the head timeout passes, on a new connection and between keep-alive requests."""
    publisher_settings = PublisherSettings(
        database_url=settings.database_url, publisher_request_head_timeout_seconds=0.3
    )
    with live_publisher(publisher_settings) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as fresh:
            fresh.sendall(b"GET /healthz HTTP/1.1\r\nHost: kb\r\n")  # no blank line: incomplete
            assert fresh.recv(1024) == b""  # closed by the server (a hang fails on the timeout)
        with socket.create_connection((host, int(port)), timeout=30) as kept:
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: kb\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):  # the head and body may split
                chunk = kept.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /hea")  # the next head, trickled
            assert kept.recv(1024) == b""
