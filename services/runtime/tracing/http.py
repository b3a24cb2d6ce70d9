"""Server spans of the HTTP app (the OpenTelemetry ASGI/FastAPI instrumentation): one
``http.server`` span per request, with the route, method and status as the HTTP semantic
conventions name them; the publisher's and search's spans are its children."""

from __future__ import annotations

import os
from typing import Any, Final

from services.runtime.tracing.setup import tracing_on

# Probes and scrapes: a span each would bury the requests that matter.
UNTRACED_PATHS: Final = "/healthz,/readyz,/metrics,/ui/static"


def trace_http_app(app: Any) -> None:
    """Instrument ``app`` when this process traces (nothing otherwise). No header's value
    is ever recorded, whatever ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*`` asks for (a
    header so named is recorded as ``[REDACTED]``): the API's headers carry keys and
    principal tokens."""
    if not tracing_on():
        return
    # The stable HTTP semantic conventions (http.request.method, url.path, ...), not the
    # instrumentation's older default, unless the operator chose otherwise. Read once, when
    # the first app is instrumented.
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app,
        excluded_urls=UNTRACED_PATHS,
        http_capture_headers_sanitize_fields=[".*"],
        # The ASGI receive/send events: two spans per request that say nothing more.
        exclude_spans=["receive", "send"],
    )
