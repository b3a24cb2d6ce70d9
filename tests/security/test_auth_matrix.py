"""Every /v1 endpoint against every way of holding the wrong credential (issue 29): no key,
a malformed one, a revoked one, another tenant's, one without the endpoint's scope, an
operator key; and a tenant key on the operator page. Every refusal is problem+json with its
stable code, changes nothing, and shows nothing of the tenant's documents; a key with the
right scope is let through (so each refusal is the credential's doing, not the request's)."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import asyncpg
import httpx
import pytest

from services.runtime.auth.keys import Scope
from tests.security.world import Caller, World, bearer
from tests.support.api import snapshot
from tests.support.operator import hidden

pytestmark = pytest.mark.integration

Send = Callable[[World, Caller], Awaitable[httpx.Response]]


def _document(world: World) -> uuid.UUID:
    return world.acme.documents[0].document_id


async def _create_document(world: World, caller: Caller) -> httpx.Response:
    return await world.client.post(
        caller.path("/documents"),
        files={"file": ("a.txt", b"new text", "text/plain")},
        data={"title": "New"},
        headers=caller.headers,
    )


async def _add_version(world: World, caller: Caller) -> httpx.Response:
    return await world.client.post(
        caller.path(f"/documents/{_document(world)}/versions"),
        files={"file": ("a.txt", b"new text", "text/plain")},
        headers=caller.headers,
    )


async def _publish(world: World, caller: Caller) -> httpx.Response:
    # Revision 999 is stale: with the right key this answers 409 and changes nothing.
    return await world.client.post(
        caller.path(f"/documents/{_document(world)}/versions/1/publish"),
        json={"revision": 999, "acl": {"read": ["group:everyone"]}},
        headers=caller.headers,
    )


async def _bulk(world: World, caller: Caller) -> httpx.Response:
    # No items part: with the right key, 400 BULK_INVALID and nothing written.
    return await world.client.post(
        caller.path("/documents/bulk"),
        files={"file": ("a.txt", b"x", "text/plain")},
        headers=caller.headers,
    )


async def _status(world: World, caller: Caller) -> httpx.Response:
    return await world.client.get(
        caller.path(f"/documents/{_document(world)}"), headers=caller.headers
    )


async def _delete(world: World, caller: Caller) -> httpx.Response:
    # Revision 999 is stale: with the right key this answers 409 and deletes nothing.
    return await world.client.delete(
        caller.path(f"/documents/{_document(world)}"),
        params={"revision": 999},
        headers=caller.headers,
    )


async def _erase(world: World, caller: Caller) -> httpx.Response:
    # An unknown document: with an admin key this answers 404 and erases nothing.
    return await world.client.post(
        caller.path(f"/documents/{uuid.uuid4()}/erase"), headers=caller.headers
    )


async def _add_ingest_key(world: World, caller: Caller) -> httpx.Response:
    # 31 bytes are no Ed25519 key: with an admin key this answers 400 and registers nothing.
    body = {"keyId": "k1", "publicKey": base64.b64encode(b"x" * 31).decode()}
    return await world.client.post(caller.path("/ingest-keys"), json=body, headers=caller.headers)


async def _list_ingest_keys(world: World, caller: Caller) -> httpx.Response:
    return await world.client.get(caller.path("/ingest-keys"), headers=caller.headers)


async def _revoke_ingest_key(world: World, caller: Caller) -> httpx.Response:
    # No such key: with an admin key this answers 404 and revokes nothing.
    return await world.client.delete(caller.path("/ingest-keys/none"), headers=caller.headers)


async def _index_task(world: World, caller: Caller) -> httpx.Response:
    return await world.client.get(
        caller.path(f"/index-tasks/{uuid.uuid4()}"), headers=caller.headers
    )


async def _search(world: World, caller: Caller) -> httpx.Response:
    return await world.search(caller, {"principals": ["group:support"]})


@dataclass(frozen=True)
class Endpoint:
    method: str
    route: str
    scope: Scope
    send: Send
    # What the right key gets: the request itself is fine or refused for its content.
    allowed: frozenset[int]


ENDPOINTS = {
    "create_document": Endpoint(
        "POST",
        "/v1/tenants/{tenantId}/documents",
        Scope.PUBLISH,
        _create_document,
        frozenset({201}),
    ),
    "add_version": Endpoint(
        "POST",
        "/v1/tenants/{tenantId}/documents/{documentId}/versions",
        Scope.PUBLISH,
        _add_version,
        frozenset({201}),
    ),
    "publish_version": Endpoint(
        "POST",
        "/v1/tenants/{tenantId}/documents/{documentId}/versions/{versionNumber}/publish",
        Scope.PUBLISH,
        _publish,
        frozenset({409}),
    ),
    "publish_many": Endpoint(
        "POST", "/v1/tenants/{tenantId}/documents/bulk", Scope.PUBLISH, _bulk, frozenset({400})
    ),
    "document_status": Endpoint(
        "GET",
        "/v1/tenants/{tenantId}/documents/{documentId}",
        Scope.PUBLISH,
        _status,
        frozenset({200}),
    ),
    "delete_document": Endpoint(
        "DELETE",
        "/v1/tenants/{tenantId}/documents/{documentId}",
        Scope.PUBLISH,
        _delete,
        frozenset({409}),
    ),
    "erase_document": Endpoint(
        "POST",
        "/v1/tenants/{tenantId}/documents/{documentId}/erase",
        Scope.ADMIN,
        _erase,
        frozenset({404}),
    ),
    "add_ingest_key": Endpoint(
        "POST", "/v1/tenants/{tenantId}/ingest-keys", Scope.ADMIN, _add_ingest_key, frozenset({400})
    ),
    "list_ingest_keys": Endpoint(
        "GET",
        "/v1/tenants/{tenantId}/ingest-keys",
        Scope.ADMIN,
        _list_ingest_keys,
        frozenset({200}),
    ),
    "revoke_ingest_key": Endpoint(
        "DELETE",
        "/v1/tenants/{tenantId}/ingest-keys/{keyId}",
        Scope.ADMIN,
        _revoke_ingest_key,
        frozenset({404}),
    ),
    "index_task": Endpoint(
        "GET",
        "/v1/tenants/{tenantId}/index-tasks/{taskId}",
        Scope.PUBLISH,
        _index_task,
        frozenset({404}),
    ),
    "search": Endpoint(
        "POST", "/v1/tenants/{tenantId}/search", Scope.SEARCH, _search, frozenset({200})
    ),
}


def test_the_matrix_covers_every_tenant_endpoint(world: World) -> None:
    # A new endpoint must join the matrix (the app's routes, as its OpenAPI document lists
    # them; no /v1 route is left out of it).
    served = {
        (method.upper(), path)
        for path, operations in world.app.openapi()["paths"].items()
        if path.startswith("/v1/")
        for method in operations
    }
    assert served == {(e.method, e.route) for e in ENDPOINTS.values()}


def _wrong_scope_key(world: World, scope: Scope) -> str:
    return world.acme.keys["search" if scope is Scope.PUBLISH else "publish"][1]


# (credential, status, code): what every endpoint answers with it.
CREDENTIALS: dict[str, tuple[int, str]] = {
    "no key": (401, "UNAUTHENTICATED"),
    "not a key": (401, "UNAUTHENTICATED"),
    "basic scheme": (401, "UNAUTHENTICATED"),
    "truncated key": (401, "UNAUTHENTICATED"),
    "unknown key": (401, "UNAUTHENTICATED"),
    "revoked key": (401, "UNAUTHENTICATED"),
    "operator key": (401, "UNAUTHENTICATED"),
    "another tenant's key": (403, "FORBIDDEN"),
    "wrong scope": (403, "KEY_SCOPE_INSUFFICIENT"),
}


def _authorization(world: World, credential: str, endpoint: Endpoint) -> str | None:
    admin = world.acme.keys["admin"][1]
    return {
        "no key": None,
        "not a key": "Bearer not-a-key",
        "basic scheme": "Basic " + admin,
        "truncated key": bearer(admin[:-20]),
        "unknown key": bearer(f"kb.acme.{'A' * 43}"),
        "revoked key": bearer(world.acme.keys["revoked"][1]),
        "operator key": bearer(world.operator_key),
        "another tenant's key": bearer(world.globex.keys["admin"][1]),
        "wrong scope": bearer(_wrong_scope_key(world, endpoint.scope)),
    }[credential]


def assert_no_leak(world: World, response: httpx.Response) -> None:
    text = response.text
    for secret in world.secrets:
        assert secret not in text
    for tenant in (world.acme, world.globex):
        for document in tenant.documents:
            assert document.title not in text


@pytest.mark.parametrize("credential", list(CREDENTIALS))
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_a_wrong_credential_is_refused_and_changes_nothing(
    world: World, endpoint: str, credential: str
) -> None:
    spec = ENDPOINTS[endpoint]
    async with world.pool.acquire() as proxy:
        conn = cast("asyncpg.Connection[Any]", proxy)
        before = await snapshot(conn)
        response = await spec.send(world, Caller("acme", _authorization(world, credential, spec)))
        after = await snapshot(conn)
    status, code = CREDENTIALS[credential]
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["errorCode"] == code
    assert after == before
    assert_no_leak(world, response)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("kind", ["admin", "scoped"])
async def test_a_key_with_the_scope_gets_through(world: World, endpoint: str, kind: str) -> None:
    spec = ENDPOINTS[endpoint]
    key = "admin" if kind == "admin" else spec.scope.value
    response = await spec.send(world, world.acme.caller(key))
    assert response.status_code in spec.allowed, response.text


async def test_a_tenant_key_does_not_open_the_operator_page(world: World) -> None:
    tenant_key = world.acme.keys["admin"][1]
    page = await world.client.get("/ui", headers={"Authorization": bearer(tenant_key)})
    assert page.status_code == 303
    assert page.headers["location"] == "/ui/login"

    form = await world.client.get("/ui/login")
    refused = await world.client.post(
        "/ui/login", data={"token": tenant_key, "login_token": hidden(form.text, "login_token")}
    )
    assert refused.status_code == 303
    assert refused.headers["location"] == "/ui/login?error=1"
    assert "kb_operator_session" not in refused.headers.get("set-cookie", "")

    # The operator key signs in: the refusal above was the tenant key's doing.
    form = await world.client.get("/ui/login")
    accepted = await world.client.post(
        "/ui/login",
        data={"token": world.operator_key, "login_token": hidden(form.text, "login_token")},
    )
    assert accepted.status_code == 303
    assert accepted.headers["location"] == "/ui"
    world.client.cookies.clear()


# --- path and header tricks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "statuses"),
    [
        # Percent-encoded tenant: the decoded path is acme's, the key is globex's.
        ("/v1/tenants/%61cme/search", {403}),
        ("/v1/tenants/ACME/search", {403, 422}),
        ("/v1/tenants/acme%2Fsearch", {403, 404}),
        ("/v1//tenants/acme/search", {404}),
        ("/v1/tenants/acme/search/", {403, 404, 307}),
        ("/v1/tenants//search", {401, 403, 404}),
        ("/v1/tenants/acme/../acme/search", {403, 404}),
    ],
)
async def test_path_tricks_open_nothing(world: World, path: str, statuses: set[int]) -> None:
    response = await world.client.post(
        path,
        json={"query": "handbook", "principals": ["group:support"]},
        headers={"Authorization": bearer(world.globex.keys["admin"][1])},
    )
    assert response.status_code in statuses, response.text
    assert response.status_code < 500
    assert_no_leak(world, response)


async def test_a_repeated_authorization_header_is_refused(world: World) -> None:
    body = json.dumps({"query": "handbook", "principals": ["group:support"]}).encode()
    response = await world.client.post(
        world.acme.caller("admin").path("/search"),
        content=body,
        headers=[
            ("content-type", "application/json"),
            ("authorization", bearer(world.globex.keys["admin"][1])),
            ("authorization", bearer(world.acme.keys["admin"][1])),
        ],
    )
    assert response.status_code == 400
    assert response.json()["errorCode"] == "DUPLICATE_HEADER"
    assert_no_leak(world, response)


@pytest.mark.parametrize(
    "header",
    [
        "bearer {key}",  # the scheme is case-insensitive (RFC 9110)
        "Bearer   {key}  ",
        "Bearer {key}\t",  # surrounding whitespace is not part of a header's value
    ],
)
async def test_harmless_spellings_of_the_header_work(world: World, header: str) -> None:
    caller = Caller("acme", header.format(key=world.acme.keys["search"][1]))
    response = await world.search(caller, {"principals": ["group:support"]})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "header",
    [
        "Bearer {key} extra",
        "Bearer{key}",
        "Token {key}",
    ],
)
async def test_other_spellings_of_the_header_are_refused(world: World, header: str) -> None:
    caller = Caller("acme", header.format(key=world.acme.keys["search"][1]))
    response = await world.search(caller, {"principals": ["group:support"]})
    assert response.status_code == 401, response.text
