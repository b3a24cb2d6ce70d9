"""The W3C ``traceparent`` (``version-traceid-spanid-flags``) of a span, as the outbox row,
the index task row and a Kafka header carry it, and the span context read back from one.

W3C trace context whatever ``OTEL_PROPAGATORS`` says: what is stored in a row outlives the
process that wrote it, so its format cannot depend on one process's configuration.
"""

from __future__ import annotations

from typing import Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_W3C = TraceContextTextMapPropagator()

# The contexts last read, by their traceparent: one attempt's spans are each started under
# the same stored or own value (five reads of one string), and the propagator's parse costs
# as much as a tenth of a span. Bounded: emptied when full (a clear is atomic, whatever
# thread reads).
_READ_CAPACITY: Final = 4096
_read: dict[str, Context | None] = {}


def current_traceparent() -> str | None:
    """The current span's ``traceparent``; None when no span is recording or tracing is off
    (the column stays NULL and nothing downstream opens a span for it)."""
    return traceparent_of(trace.get_current_span().get_span_context())


def traceparent_of(context: trace.SpanContext) -> str | None:
    if not context.is_valid:
        return None
    # What the W3C propagator's inject writes (version 00), without its carrier and context.
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def span_context_of(traceparent: str | bytes | None) -> trace.SpanContext | None:
    """The remote span context a stored or received ``traceparent`` names; None for none or
    a malformed one (a bad header is ignored, never an error)."""
    context = context_of(traceparent)
    return None if context is None else trace.get_current_span(context).get_span_context()


def context_of(traceparent: str | bytes | None) -> Context | None:
    """A context whose parent is the span ``traceparent`` names (None: no such span): what
    a span continuing that trace starts in."""
    if traceparent is None:
        return None
    if isinstance(traceparent, bytes):
        try:
            traceparent = traceparent.decode("ascii")
        except UnicodeDecodeError:
            return None
    try:
        return _read[traceparent]
    except KeyError:
        pass
    span_context = trace.get_current_span(
        _W3C.extract({TRACEPARENT: traceparent})
    ).get_span_context()
    context = (
        trace.set_span_in_context(trace.NonRecordingSpan(span_context))
        if span_context.is_valid
        else None
    )
    if len(_read) >= _READ_CAPACITY:
        _read.clear()
    _read[traceparent] = context
    return context
