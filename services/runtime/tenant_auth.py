"""Which tenant the HTTP request was authenticated for, and the check every tenant route
makes of it.

The tenant-auth middleware authenticates every ``/v1/tenants/{t}/...`` request before
routing and stores the tenant in ``scope["state"][AUTHENTICATED_TENANT]``. Routes check it
again: should a request ever reach one without passing the middleware (a route mounted
outside it, a middleware dropped by mistake), it is refused, not served.
"""

from __future__ import annotations

from typing import Final

from starlette.requests import Request

from services.runtime.errors import Unauthenticated

AUTHENTICATED_TENANT: Final = "kb.authenticated_tenant"


def require_authenticated_tenant(request: Request, tenant_id: str) -> None:
    """Fail closed: serve a tenant path only to a request authenticated for exactly that
    tenant."""
    if request.scope.get("state", {}).get(AUTHENTICATED_TENANT) != tenant_id:
        raise Unauthenticated("send a valid tenant API key: Authorization: Bearer <key>")
