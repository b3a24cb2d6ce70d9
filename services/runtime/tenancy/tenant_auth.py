"""Tenant authentication for every ``/v1/tenants/{tenantId}/...`` route family
(docs/security.md).

API keys look like ``kb.<tenant>.<secret>``; only the key's SHA-256 is stored. The tenant
inside the key lets every key lookup carry the tenant id in its WHERE clause, and lets a key
presented on another tenant's path be told apart (403) from a key that is simply wrong (401).

:class:`TenantAuthMiddleware` checks the key before routing, validation or body parsing
(nothing caches the answer: a revoked key fails from the next request on) and records the
:class:`AuthenticatedCaller` in the request's state; routes depend on :func:`require_scope`,
which fails closed: a request that did not pass the middleware for exactly that tenant, or
whose key lacks the route's scope, is refused, never served. Failed authentications are
counted per client address (services/runtime/auth/throttle.py): a try is reserved before
the key is looked up, and beyond the allowance an address is answered 429 before its key is
even looked at.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as AsgiScope

from services.runtime.auth.keys import ApiKeyGrant, PrincipalSource, Scope, TenantCredentials
from services.runtime.auth.settings import AuthSettings
from services.runtime.auth.throttle import FailedAuthThrottle, Refused, peer_host
from services.runtime.auth.tokens import PrincipalClaims, verify_principal_token
from services.runtime.errors import BadInput, Forbidden, KbError, Unauthenticated
from services.runtime.logging import get_logger
from services.runtime.web.http_problem import kb_error_response, problem_response

log = get_logger(__name__)

AUTHENTICATED_TENANT: Final = "kb.authenticated_tenant"
AUTHENTICATED_CALLER: Final = "kb.authenticated_caller"
KEY_PREFIX: Final = "kb"
AUTH_FAILURES_THROTTLED: Final = "AUTH_FAILURES_THROTTLED"
_KEY: Final = re.compile(
    r"^kb\.(?P<tenant>[a-z0-9][a-z0-9-]{0,62})\.(?P<secret>[A-Za-z0-9_-]{32,128})$"
)
_TENANT_PATH: Final = re.compile(r"^/v1/tenants/(?P<tenant>[^/]*)(?:/|$)")
_UNAUTHENTICATED: Final = "send a valid tenant API key: Authorization: Bearer <key>"


class KeyScopeInsufficient(Forbidden, code="KEY_SCOPE_INSUFFICIENT"):
    """The key is valid for this tenant but lacks the scope the call needs."""


class PrincipalsNotAllowed(BadInput, code="PRINCIPALS_NOT_ALLOWED"):
    """The request names principals (or a token) where its key decides them."""


class PrincipalTokenRequired(Unauthenticated, code="PRINCIPAL_TOKEN_REQUIRED"):
    """The key searches only with a verified principal token, and the request has none."""


class PrincipalsRequired(BadInput, code="PRINCIPALS_REQUIRED", http_status=422):
    """A search names no principals and sends no principal token."""


@dataclass(frozen=True)
class PresentedKey:
    tenant_id: str
    key_hash: bytes


@dataclass(frozen=True)
class AuthenticatedCaller:
    """Who a request authenticated as: its tenant and what its key may do (never the key)."""

    tenant_id: str
    grant: ApiKeyGrant
    credentials: TenantCredentials
    settings: AuthSettings


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


def authenticated_caller(request: Request, tenant_id: str) -> AuthenticatedCaller:
    """The caller the middleware authenticated for exactly ``tenant_id`` (a route
    dependency: should a request ever reach a route without passing the middleware, it is
    refused)."""
    state = request.scope.get("state", {})
    caller = state.get(AUTHENTICATED_CALLER)
    if state.get(AUTHENTICATED_TENANT) != tenant_id or not isinstance(caller, AuthenticatedCaller):
        raise Unauthenticated(_UNAUTHENTICATED)
    return caller


def require_scope(request: Request, tenant_id: str, scope: Scope) -> AuthenticatedCaller:
    """:func:`authenticated_caller`, whose key must also have ``scope`` (403
    ``KEY_SCOPE_INSUFFICIENT`` otherwise)."""
    caller = authenticated_caller(request, tenant_id)
    if not caller.grant.allows(scope):
        raise KeyScopeInsufficient(f"this API key has no {scope.value} scope")
    return caller


async def search_principals(
    caller: AuthenticatedCaller,
    requested: Sequence[str] | None,
    token: str | None,
    *,
    max_principals: int,
    max_principal_chars: int,
) -> tuple[tuple[str, ...], PrincipalClaims | None]:
    """The principals a search runs with, and the token's claims when a token decided them.

    - a key bound to fixed principals: those; the request may name neither principals nor
      a token (400 ``PRINCIPALS_NOT_ALLOWED``);
    - a key that requires a token: the token's principals only (401 without one; 400 when
      the request also names principals);
    - any other key: the token's principals when a token is sent (then the request must
      not name principals too), else the request's.
    """
    grant = caller.grant
    if grant.principal_source is PrincipalSource.FIXED:
        if requested is not None or token is not None:
            raise PrincipalsNotAllowed(
                "this API key searches as the principals it is bound to: send neither "
                "principals nor a principal token"
            )
        return grant.principals or (), None
    if grant.principal_source is PrincipalSource.TOKEN and requested is not None:
        raise PrincipalsNotAllowed(
            "this API key searches only with a principal token's principals: send "
            "principalToken, not principals"
        )
    if token is not None:
        if requested is not None:
            raise PrincipalsNotAllowed(
                "send principals or a principal token, not both: with a token the search "
                "uses only the token's principals"
            )
        claims = await verify_principal_token(
            token,
            tenant_id=caller.tenant_id,
            find_key=lambda kid: caller.credentials.verification_key(caller.tenant_id, kid),
            settings=caller.settings,
            max_principals=max_principals,
            max_principal_chars=max_principal_chars,
        )
        return claims.principals, claims
    if grant.principal_source is PrincipalSource.TOKEN:
        raise PrincipalTokenRequired(
            "this API key searches only with a principal token: send principalToken"
        )
    if requested is None:
        raise PrincipalsRequired("name the principals to search as, or send a principalToken")
    return tuple(requested), None


class TenantAuthMiddleware:
    """Authenticate every ``/v1/tenants/{t}/...`` request before anything else looks at it:
    429 for an address with too many failures, 401 without a valid key, 403 with another
    tenant's key."""

    def __init__(
        self,
        app: ASGIApp,
        key_checker: Callable[[], TenantCredentials],
        settings: AuthSettings | None = None,
        throttle: FailedAuthThrottle | None = None,
    ) -> None:
        self.app = app
        # Called per request: the checker may be built after the app (in its lifespan).
        self.key_checker = key_checker
        self.settings = settings or AuthSettings()
        self.throttle = throttle or FailedAuthThrottle.from_settings(self.settings)

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        match = _TENANT_PATH.match(route_path(scope)) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        host = peer_host(scope)
        # Reserved before the lookup: concurrent bad keys cannot all reach the database.
        reservation = await self.throttle.reserve(host)
        if isinstance(reservation, Refused):
            await _throttled(scope, reservation.retry_after)(scope, receive, send)
            return
        try:
            caller = await self._authenticate(scope, path_tenant=match["tenant"])
        except KbError as error:
            if error.http_status != 401:
                reservation.release()  # a valid key in the wrong place is no guess
            elif reservation.failed():
                self._log_throttled(host)
            await kb_error_response(error, scope["path"])(scope, receive, send)
            return
        except BaseException:
            reservation.release()
            raise
        reservation.release()  # a good key: the try is back
        counted = _CountingFailures(send, lambda: self._record_failure(host))
        state = scope.setdefault("state", {})
        state[AUTHENTICATED_TENANT] = caller.tenant_id
        state[AUTHENTICATED_CALLER] = caller
        # A 401 the routes answer (a bad principal token) counts as a failure too.
        await self.app(scope, receive, counted)

    def _record_failure(self, host: str) -> None:
        if self.throttle.record_failure(host):
            self._log_throttled(host)

    def _log_throttled(self, host: str) -> None:
        # Once per address and episode, not per refused request: an attack must not flood
        # the log it is meant to show up in.
        log.warning("auth.throttled", client_address=self.throttle.address(host))

    async def _authenticate(self, scope: AsgiScope, *, path_tenant: str) -> AuthenticatedCaller:
        authorization = None
        for name, value in scope["headers"]:
            if name.lower() == b"authorization":
                authorization = value.decode("latin-1")
        token = bearer_token(authorization)
        presented = parse_api_key(token) if token is not None else None
        if presented is None:
            raise Unauthenticated(_UNAUTHENTICATED)
        credentials = self.key_checker()
        grant = await credentials.api_key(presented.tenant_id, presented.key_hash)
        if grant is None:
            raise Unauthenticated(_UNAUTHENTICATED)
        if presented.tenant_id != path_tenant:  # ASGI paths arrive percent-decoded
            raise Forbidden("this API key belongs to another tenant")
        return AuthenticatedCaller(presented.tenant_id, grant, credentials, self.settings)


class _CountingFailures:
    """A ``send`` that records a failed authentication when the answer is 401."""

    def __init__(self, send: Send, record: Callable[[], None]) -> None:
        self._send = send
        self._record = record

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 401:
            self._record()
        await self._send(message)


def _throttled(scope: AsgiScope, wait: float) -> ASGIApp:
    return problem_response(
        429,
        AUTH_FAILURES_THROTTLED,
        "too many failed authentications from this address: retry after the time in Retry-After",
        instance=scope.get("path"),
        headers={"Retry-After": str(max(1, math.ceil(wait)))},
    )


def route_path(scope: AsgiScope) -> str:
    """The path the router matches: behind a proxy prefix (``root_path``) the ASGI path
    still carries the prefix, and the router strips it before matching."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        return path[len(root_path) :] or "/"
    return path
