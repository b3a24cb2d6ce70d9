"""Tenant authentication for every ``/v1/tenants/{tenantId}/...`` route family.

API keys look like ``kb.<tenant>.<secret>``; only the key's SHA-256 is stored. The tenant
inside the key lets every key lookup carry the tenant id in its WHERE clause, and lets a key
presented on another tenant's path be told apart (403) from a key that is simply wrong (401).

:class:`TenantAuthMiddleware` checks the key before routing, validation or body parsing and
records the tenant it authenticated in the request's state; routes depend on
:func:`require_authenticated_tenant`, which fails closed: a request that did not pass the
middleware for exactly that tenant is refused, never served.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.runtime.errors import Forbidden, KbError, Unauthenticated
from services.runtime.http_problem import kb_error_response

AUTHENTICATED_TENANT: Final = "kb.authenticated_tenant"
KEY_PREFIX: Final = "kb"
_KEY: Final = re.compile(
    r"^kb\.(?P<tenant>[a-z0-9][a-z0-9-]{0,62})\.(?P<secret>[A-Za-z0-9_-]{32,128})$"
)
_TENANT_PATH: Final = re.compile(r"^/v1/tenants/(?P<tenant>[^/]*)(?:/|$)")
_UNAUTHENTICATED: Final = "send a valid tenant API key: Authorization: Bearer <key>"


class ApiKeyChecker(Protocol):
    async def api_key_is_valid(self, tenant_id: str, key_hash: bytes) -> bool: ...


@dataclass(frozen=True)
class PresentedKey:
    tenant_id: str
    key_hash: bytes


def new_api_key(tenant_id: str) -> str:
    return f"{KEY_PREFIX}.{tenant_id}.{secrets.token_urlsafe(32)}"


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_api_key(key: str) -> PresentedKey | None:
    """The tenant a well-formed key claims to belong to and its hash; ``None`` if malformed."""
    match = _KEY.fullmatch(key)
    if match is None:
        return None
    return PresentedKey(tenant_id=match["tenant"], key_hash=hash_api_key(key))


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require_authenticated_tenant(request: Request, tenant_id: str) -> None:
    """Serve a tenant path only to a request the middleware authenticated for exactly that
    tenant (a route dependency: should a request ever reach a route without passing the
    middleware, it is refused)."""
    if request.scope.get("state", {}).get(AUTHENTICATED_TENANT) != tenant_id:
        raise Unauthenticated(_UNAUTHENTICATED)


class TenantAuthMiddleware:
    """Authenticate every ``/v1/tenants/{t}/...`` request before anything else looks at it:
    401 without a valid key, 403 with another tenant's key."""

    def __init__(self, app: ASGIApp, key_checker: Callable[[], ApiKeyChecker]) -> None:
        self.app = app
        # Called per request: the checker may be built after the app (in its lifespan).
        self.key_checker = key_checker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _TENANT_PATH.match(_route_path(scope)) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        try:
            tenant_id = await self._authenticate(scope, path_tenant=match["tenant"])
        except KbError as error:
            await kb_error_response(error, scope["path"])(scope, receive, send)
            return
        scope.setdefault("state", {})[AUTHENTICATED_TENANT] = tenant_id
        await self.app(scope, receive, send)

    async def _authenticate(self, scope: Scope, *, path_tenant: str) -> str:
        authorization = None
        for name, value in scope["headers"]:
            if name.lower() == b"authorization":
                authorization = value.decode("latin-1")
        token = bearer_token(authorization)
        presented = parse_api_key(token) if token is not None else None
        if presented is None or not await self.key_checker().api_key_is_valid(
            presented.tenant_id, presented.key_hash
        ):
            raise Unauthenticated(_UNAUTHENTICATED)
        if presented.tenant_id != path_tenant:  # ASGI paths arrive percent-decoded
            raise Forbidden("this API key belongs to another tenant")
        return presented.tenant_id


def _route_path(scope: Scope) -> str:
    """The path the router matches: behind a proxy prefix (``root_path``) the ASGI path
    still carries the prefix, and the router strips it before matching."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        return path[len(root_path) :] or "/"
    return path
