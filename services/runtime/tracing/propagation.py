"""The W3C ``traceparent`` (``version-traceid-spanid-flags``) of a span, as the outbox row,
the index task row and a Kafka header carry it, and the span context read back from one.

W3C trace context whatever ``OTEL_PROPAGATORS`` says: what is stored in a row outlives the
process that wrote it, so its format cannot depend on one process's configuration.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_W3C = TraceContextTextMapPropagator()


def current_traceparent() -> str | None:
    """The current span's ``traceparent``; None when no span is recording or tracing is off
    (the column stays NULL and nothing downstream opens a span for it)."""
    return traceparent_of(trace.get_current_span().get_span_context())


def traceparent_of(context: trace.SpanContext) -> str | None:
    if not context.is_valid:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(trace.NonRecordingSpan(context)))
    return carrier.get(TRACEPARENT)


def span_context_of(traceparent: str | bytes | None) -> trace.SpanContext | None:
    """The remote span context a stored or received ``traceparent`` names; None for none or
    a malformed one (a bad header is ignored, never an error)."""
    if traceparent is None:
        return None
    if isinstance(traceparent, bytes):
        try:
            traceparent = traceparent.decode("ascii")
        except UnicodeDecodeError:
            return None
    context = trace.get_current_span(_W3C.extract({TRACEPARENT: traceparent})).get_span_context()
    return context if context.is_valid else None


def context_of(traceparent: str | bytes | None) -> Context | None:
    """A context whose parent is the span ``traceparent`` names (None: no such span): what
    a span continuing that trace starts in."""
    span_context = span_context_of(traceparent)
    if span_context is None:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))
