"""Prometheus metrics of the publisher. Labels are low-cardinality only: method, route
template, status code, operation, result (an error code or ``ok``) — never tenant, document
or task ids."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import Message, Receive, Scope, Send

from services.publisher.web.middleware import HttpMiddleware

_KNOWN_METHODS: Final = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
UNMATCHED_ROUTE: Final = "<unmatched>"


class PublisherMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Each app has its own registry: two apps in one process (tests) never collide.
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "kb_http_requests",
            "HTTP requests answered, by route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "kb_http_request_duration_seconds",
            "Time to answer an HTTP request.",
            ["method", "route"],
            registry=self.registry,
        )
        self.operations = Counter(
            "kb_publisher_operations",
            "Publisher operations by outcome: ok, unchanged (a repeated publish) or an error code.",
            ["operation", "result"],
            registry=self.registry,
        )
        # A replica's name (host:port/database) is low-cardinality: KB_SEARCH_DATABASE_URLS.
        self.status_reads = Counter(
            "kb_publisher_status_reads",
            "Document status reads by the server that answered: primary or a read replica.",
            ["server"],
            registry=self.registry,
        )
        self.upload_bytes = Histogram(
            "kb_publisher_upload_bytes",
            "Size of accepted document versions.",
            buckets=(1e3, 1e4, 1e5, 1e6, 5e6, 1e7, 2.5e7, 1e8),
            registry=self.registry,
        )


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
