"""The publisher's request counter: every HTTP answer by method, route template and status,
and how long it took (the counters are ``PublisherMetrics``'s)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from starlette.types import Message, Receive, Scope, Send

from services.publisher.metrics import PublisherMetrics
from services.publisher.web.middleware import HttpMiddleware

_KNOWN_METHODS: Final = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
UNMATCHED_ROUTE: Final = "<unmatched>"


@dataclass(eq=False)
class MetricsMiddleware(HttpMiddleware):
    """Counts every answer, including those given before routing (401, 413, 404)."""

    metrics: PublisherMetrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            method = scope["method"] if scope["method"] in _KNOWN_METHODS else "OTHER"
            route = _route_template(scope)
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.request_seconds.labels(method, route).observe(
                time.perf_counter() - started
            )


def _route_template(scope: Scope) -> str:
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE
