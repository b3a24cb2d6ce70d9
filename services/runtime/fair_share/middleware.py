"""The ASGI middleware ``services/app.py`` puts inside tenant authentication: it finds the
route a request is for, and holds a search's or a publish's fair share around it. A search's
slot is not taken here: the search takes it once it is ready to read and gives it back
before its answer is written (``phases.search_slot``), so neither a wait for a read replica
nor a client that does not read its answer keeps a slot from other tenants.

Placed inside the body-size limit and before anything parses the body: a refused request
costs its key check (and its tenant's tier, read once a minute), never a JSON parse or a
database round trip of its own. A refused body is read and dropped before the answer
(bounded by the body limit outside), as the upload budget does, unless the client sent
``Expect: 100-continue``: a server that closes a connection with unread data in it resets
it, and the client may lose the answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from services.runtime.fair_share.gate import FairShare
from services.runtime.fair_share.settings import Kind
from services.runtime.fair_share.shares import TenantLimited
from services.runtime.tenancy.tenant_auth import AUTHENTICATED_TENANT, route_path
from services.runtime.web.http_problem import PROBLEM_RESPONSE, refuse_unread

# The 429 of a route that takes a share, as its OpenAPI document describes it.
LIMITED_RESPONSE: Final[dict[str, Any]] = {
    **PROBLEM_RESPONSE,
    "description": (
        "The tenant is beyond its share of this server (its tier's limits): "
        "`TENANT_CONCURRENCY_LIMITED`, too many of its requests of this kind in progress; "
        "`TENANT_RATE_LIMITED`, more of them a second than its rate allows; "
        "`SEARCH_SLOT_WAIT_TIMEOUT`, a search found none of the server's search slots free "
        "in time. Retry after the seconds in `Retry-After`."
    ),
    "headers": {
        "Retry-After": {
            "description": "Seconds to wait before trying again.",
            "schema": {"type": "integer"},
        }
    },
}


@dataclass(frozen=True)
class LimitedRoute:
    """A route that takes a share: its template (``/v1/tenants/{tenantId}/search``, the
    label of its HTTP metrics), method and kind."""

    path: str
    kind: Kind
    method: str = "POST"
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", compile_path(self.path)[0])

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and self.pattern.match(path) is not None


def limited_routes(kinds: Mapping[str, Kind]) -> list[LimitedRoute]:
    return [LimitedRoute(path, kind) for path, kind in kinds.items()]


class FairShareMiddleware:
    def __init__(
        self, app: ASGIApp, *, fair_share: FairShare, routes: Sequence[LimitedRoute]
    ) -> None:
        self.app = app
        self.fair_share = fair_share
        # The routes that take a share (services/app.py names them).
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant_id = scope.get("state", {}).get(AUTHENTICATED_TENANT)
        limited = self._route(scope) if scope["type"] == "http" and tenant_id else None
        if limited is None:
            # Not a limited route, or not authenticated (its route refuses it).
            await self.app(scope, receive, send)
            return
        try:
            async with self.fair_share.admit(tenant_id, limited.kind):
                await self.app(scope, receive, send)
        except TenantLimited as refusal:
            # The route template labels the refusal's HTTP metrics, as if routed.
            scope["route"] = limited
            await self._refuse(refusal, scope, receive, send)

    def _route(self, scope: Scope) -> LimitedRoute | None:
        path = route_path(scope)
        return next((r for r in self.routes if r.matches(scope["method"], path)), None)

    async def _refuse(
        self, refusal: TenantLimited, scope: Scope, receive: Receive, send: Send
    ) -> None:
        await refuse_unread(
            scope,
            receive,
            send,
            status=429,
            code=refusal.code,
            message=refusal.message,
            retry_after_seconds=refusal.retry_after_seconds,
        )
