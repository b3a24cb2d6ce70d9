"""Tracing in a test process: spans exported to memory, the global provider put back
afterwards (the SDK allows one provider per process; tests need one each), and helpers to
read spans' parents and links."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.runtime.tracing import setup


@contextmanager
def traced() -> Iterator[InMemorySpanExporter]:
    """Spans recorded while inside; tracing is off again after (no provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # What trace.set_tracer_provider does, without its once-per-process guard.
    trace._TRACER_PROVIDER = provider
    setup._configured = provider
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER = None
        setup._configured = None
        provider.shutdown()


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, f"{len(found)} spans named {name}: {[s.name for s in spans]}"
    return found[0]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def ancestors(spans: Sequence[ReadableSpan], span: ReadableSpan) -> list[ReadableSpan]:
    """``span``'s parent, its parent's parent, ... as far as ``spans`` hold them."""
    by_id = {span_id(s): s for s in spans}
    found: list[ReadableSpan] = []
    parent = parent_id(span)
    while parent is not None and parent in by_id:
        found.append(by_id[parent])
        parent = parent_id(by_id[parent])
    return found


def span_id(span: ReadableSpan) -> int:
    context = span.context
    assert context is not None
    return int(context.span_id)


def trace_id(span: ReadableSpan) -> int:
    context = span.context
    assert context is not None
    return int(context.trace_id)


def linked_span_ids(span: ReadableSpan) -> list[int]:
    return [link.context.span_id for link in span.links]


def every_recorded_text(spans: Sequence[ReadableSpan]) -> str:
    """Every attribute (of spans, events, links and resources) and every name, as one text:
    what a scan for content that must never be exported reads."""
    parts: list[Any] = []
    for span in spans:
        parts.append(span.name)
        parts.extend(_flat(span.attributes))
        parts.extend(_flat(span.resource.attributes))
        for event in span.events:
            parts.append(event.name)
            parts.extend(_flat(event.attributes))
        for link in span.links:
            parts.extend(_flat(link.attributes))
        if span.status.description:
            parts.append(span.status.description)
    return "\n".join(str(part) for part in parts)


def _flat(attributes: Any) -> list[Any]:
    return [f"{key}={value}" for key, value in dict(attributes or {}).items()]
