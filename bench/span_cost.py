"""What one of our spans costs, the SDK's span against the lean one
(``services/runtime/tracing/lean.py``), in the same process and run.

    uv run --frozen python -m bench.span_cost --rounds 15 --repeat 2000

Two shapes, each made the two ways, alternating round by round (which goes first
alternating too): **search**, a vector search's three spans (``kb.search`` around
``kb.search.embed_query`` and ``kb.search.vector_list``, their attributes as the searcher
sets them); **document**, an attempt's own spans (``kb.index.attempt`` with its seven
attributes, ``kb.index.claim``, ``kb.index.parse_and_chunk`` and ``kb.index.switch``, each
with a link, and the attempt's two events). The SDK's way is what ``spans.span_under`` did
before the lean path: the SDK tracer's ``start_span`` and the span made current by a
generator; the lean way is ``spans.span_under`` and ``spans.start_span`` as they are.
Spans go to a ``BatchSpanProcessor`` whose exporter drops them, so the figure is the
process's CPU (``time.process_time``) to make them; encoding them to OTLP (what the export
thread does) is measured apart, on the spans each way made. Each figure is the median of
the rounds, in µs per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Span

from services.runtime.tracing import spans
from services.runtime.tracing.propagation import context_of

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
Under = Callable[..., AbstractContextManager[Span]]
Start = Callable[..., Span]


class Kept(SpanExporter):
    """Drops what it is given, or keeps it for the encoding's measure."""

    def __init__(self) -> None:
        self.keep = False
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.keep:
            self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def sdk_ways(provider: TracerProvider) -> tuple[Under, Start]:
    """The SDK's own span, made current as ``spans.span_under`` did before the lean path."""
    tracer = provider.get_tracer(spans.TRACER_NAME)

    def start(name: str, traceparent: str | None, **options: Any) -> Span:
        return tracer.start_span(
            name,
            context=context_of(traceparent),
            attributes=options.get("attributes"),
            links=options.get("links", ()),
            record_exception=False,
            set_status_on_exception=False,
        )

    @contextmanager
    def under(name: str, traceparent: str | None, **options: Any) -> Iterator[Span]:
        span = start(name, traceparent, **options)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield span
        except BaseException as error:
            spans.mark_failed(span, error)
            raise
        finally:
            otel_context.detach(token)
            span.end()

    return under, start


def search(under: Under, _start: Start) -> None:
    with under("kb.search", None, attributes={spans.TENANT_ID: "t1", "kb.search.mode": "vector"}):
        with under(
            "kb.search.embed_query", None, attributes={"gen_ai.request.model": "m", "kb.n": 1}
        ):
            pass
        with under(
            "kb.search.vector_list",
            None,
            attributes={
                "db.system.name": "postgresql",
                "db.operation.name": "SELECT",
                "kb.search.path": "ann",
            },
        ) as listed:
            listed.set_attribute("db.response.returned_rows", 10)


def document(under: Under, start: Start) -> None:
    ids = spans.document_attributes("t1", "3f0c6f7e-46aa-4b8e-9d3c-6a1f7c0e2b11", 1)
    attempt = start(
        "kb.index.attempt",
        TRACEPARENT,
        attributes={**ids, spans.TASK_ID: "42", spans.LEASE_ATTEMPT: 1, "kb.tier": "standard"},
    )
    own = trace.set_span_in_context(attempt)
    token = otel_context.attach(own)
    try:
        start("kb.index.claim", None, attributes={spans.TASK_ID: "42"}).end()
        spans.mark("kb.index.loaded")
        link = [Link(attempt.get_span_context())]
        with under("kb.index.parse_and_chunk", None, attributes={"kb.chunks": 3}, links=link):
            pass
        spans.mark("kb.index.commit_queued")
        with under("kb.index.switch", None, attributes=ids, links=link):
            pass
    finally:
        otel_context.detach(token)
    attempt.set_attribute("kb.attempt.result", "indexed")
    attempt.end()


def cpu_us(shape: Callable[[Under, Start], None], ways: tuple[Under, Start], repeat: int) -> float:
    started = time.process_time()
    for _ in range(repeat):
        shape(*ways)
    return (time.process_time() - started) / repeat * 1e6


def encode_us(
    shape: Callable[[Under, Start], None],
    ways: tuple[Under, Start],
    provider: TracerProvider,
    kept: Kept,
) -> float:
    kept.keep, kept.spans = True, []
    for _ in range(200):
        shape(*ways)
    provider.force_flush()
    kept.keep = False
    started = time.process_time()
    for _ in range(5):
        encode_spans(kept.spans).SerializeToString()
    return (time.process_time() - started) / 5 / 200 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    kept = Kept()
    provider = TracerProvider(resource=Resource.create({"service.name": "kb-bench"}))
    provider.add_span_processor(BatchSpanProcessor(kept, max_queue_size=1 << 20))
    trace.set_tracer_provider(provider)
    lean: tuple[Under, Start] = (spans.span_under, spans.start_span)
    ways = {"sdk": sdk_ways(provider), "lean": lean}
    report: dict[str, Any] = {"rounds": args.rounds, "repeat": args.repeat}
    for name, shape in (("search", search), ("document", document)):
        made: dict[str, list[float]] = {"sdk": [], "lean": []}
        for round_ in range(args.rounds):
            for way in ("sdk", "lean") if round_ % 2 else ("lean", "sdk"):
                made[way].append(cpu_us(shape, ways[way], args.repeat))
            provider.force_flush()
        encoded = {way: encode_us(shape, ways[way], provider, kept) for way in ways}
        sdk, lean_us = (statistics.median(made[w]) for w in ("sdk", "lean"))
        report[name] = {
            "make_us": {"sdk": round(sdk, 1), "lean": round(lean_us, 1)},
            "make_lean_over_sdk": round(lean_us / sdk, 3),
            "encode_us": {w: round(v, 1) for w, v in encoded.items()},
            "encode_lean_over_sdk": round(encoded["lean"] / encoded["sdk"], 3),
        }
    provider.shutdown()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
