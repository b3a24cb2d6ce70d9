"""Prometheus metrics of the publisher. Labels are low-cardinality only: method, route
template, status code, operation, result (an error code or ``ok``) — never tenant, document
or task ids."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.runtime.errors import KbError


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

    @contextmanager
    def counting_errors(self, operation: str) -> Iterator[None]:
        """Counts a typed error of ``operation`` by its code, and lets it go on; the
        caller counts the outcome it knows (``ok``, ``unchanged``)."""
        try:
            yield
        except KbError as error:
            self.operations.labels(operation, error.code).inc()
            raise
