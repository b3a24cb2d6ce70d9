"""``trace_id`` and ``span_id`` on every log line written while a span is recording, so a
log line leads to its trace (and a trace to its log lines)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from opentelemetry import trace


def add_trace_ids(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: the ids as the OTLP backends print them (hex, 32 and 16
    digits). Nothing when no span is active or tracing is off."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event
