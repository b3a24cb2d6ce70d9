"""The lean span path (``services/runtime/tracing/lean.py``) against the SDK's own tracer:
the same calls, with the same ids, times, sampler, limits, resource and scope, export
equal spans, field by field and as OTLP bytes, and hand the processors equal spans at
their start."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    TracerProvider,
    _TracerConfig,
)
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceState,
)

from services.runtime.errors import ConfigError
from services.runtime.tracing import spans as kb_spans
from services.runtime.tracing.lean import LeanSpan, LeanTracer
from services.runtime.tracing.propagation import context_of
from services.runtime.tracing.spans import mark_failed, span_under, start_span
from tests.support.tracing import traced

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"
T0 = 1_760_000_000_000_000_000


class Start(Protocol):
    def __call__(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Sequence[Link] = (),
        start_time: int | None = None,
    ) -> trace.Span: ...


class SeededIds(IdGenerator):
    """The same ids, in the same order, for each path."""

    def __init__(self) -> None:
        self._random = random.Random(46)

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) | 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) | 1

    def is_trace_id_random(self) -> bool:
        return True


class Started(SpanProcessor):
    """What a processor sees of a span at its start and as it ends."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        self.seen.append(
            ("start", span.name, span.context, span.parent, dict(span.attributes), span.kind)
        )

    def _on_ending(self, span: Any) -> None:
        self.seen.append(("ending", span.name, span.context, span.end_time))


@dataclass
class Run:
    spans: list[ReadableSpan]
    returned: list[trace.Span]
    seen: list[tuple[Any, ...]] = field(default_factory=list)


def run_both(
    scenario: Callable[[Start], list[trace.Span]],
    sampler: Sampler = DEFAULT_ON,
    limits: SpanLimits | None = None,
    prepare: Callable[[SdkTracer], None] = lambda tracer: None,
) -> tuple[Run, Run]:
    """``scenario`` through the SDK's tracer, then through the lean path, each with a
    provider of its own configured alike."""
    runs = []
    for lean in (False, True):
        exporter = InMemorySpanExporter()
        started = Started()
        provider = TracerProvider(
            sampler=sampler,
            resource=Resource.create({"service.name": "kb-test", "kb.region": "eu"}),
            id_generator=SeededIds(),
            span_limits=limits,
            shutdown_on_exit=False,
        )
        provider.add_span_processor(started)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        sdk = provider.get_tracer("kb-pipeline", "4.6", "https://schema/1", {"kb.scope": 1})
        assert isinstance(sdk, SdkTracer)
        prepare(sdk)
        start: Start = (
            LeanTracer(sdk).start_span
            if lean
            else partial(sdk.start_span, record_exception=False, set_status_on_exception=False)
        )
        returned = scenario(start)
        runs.append(Run(list(exporter.get_finished_spans()), returned, started.seen))
        provider.shutdown()
    return runs[0], runs[1]


def fields(span: ReadableSpan) -> dict[str, Any]:
    scope = span.instrumentation_scope
    assert scope is not None
    return {
        "name": span.name,
        "kind": span.kind,
        "context": _context(span.context),
        "parent": _context(span.parent),
        "attributes": list(dict(span.attributes or {}).items()),
        "dropped_attributes": span.dropped_attributes,
        "events": [
            (e.name, e.timestamp, dict(e.attributes or {}), e.dropped_attributes)
            for e in span.events
        ],
        "dropped_events": span.dropped_events,
        "links": [
            (_context(link.context), dict(link.attributes or {}), link.dropped_attributes)
            for link in span.links
        ],
        "dropped_links": span.dropped_links,
        "status": (span.status.status_code, span.status.description),
        "times": (span.start_time, span.end_time),
        "resource": (dict(span.resource.attributes), span.resource.schema_url),
        "scope": (scope.name, scope.version, scope.schema_url, dict(scope.attributes or {})),
        "info": span._instrumentation_info,
    }


def _context(context: SpanContext | None) -> Any:
    if context is None:
        return None
    return (
        context.trace_id,
        context.span_id,
        context.is_remote,
        int(context.trace_flags),
        tuple(context.trace_state.items()),
    )


def assert_equal_runs(sdk: Run, lean: Run) -> None:
    assert [fields(s) for s in lean.spans] == [fields(s) for s in sdk.spans]
    assert (
        encode_spans(lean.spans).SerializeToString() == encode_spans(sdk.spans).SerializeToString()
    )
    assert lean.seen == sdk.seen
    assert [_context(s.get_span_context()) for s in lean.returned] == [
        _context(s.get_span_context()) for s in sdk.returned
    ]
    assert [s.is_recording() for s in lean.returned] == [s.is_recording() for s in sdk.returned]


def remote(traceparent: str, state: TraceState | None = None) -> Context:
    context = context_of(traceparent)
    assert context is not None
    found = trace.get_current_span(context).get_span_context()
    if state is None:
        return context
    with_state = SpanContext(
        found.trace_id, found.span_id, True, found.trace_flags, trace_state=state
    )
    return trace.set_span_in_context(NonRecordingSpan(with_state))


@contextmanager
def current(span: trace.Span) -> Iterator[None]:
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def root(start: Start) -> list[trace.Span]:
    span = start(
        "kb.root",
        context=Context(),
        kind=SpanKind.SERVER,
        attributes={"kb.a": "x", "kb.n": 1, "kb.f": 0.5, "kb.b": True},
        start_time=T0,
    )
    span.set_attribute("kb.a", "y")  # set again: moves to the end, as the SDK's
    span.set_attributes({"kb.m": 2, "kb.n": 3})
    span.add_event("kb.loaded", timestamp=T0 + 1)
    span.add_event("kb.queued", {"kb.k": 1, "kb.l": "z"}, timestamp=T0 + 2)
    span.update_name("kb.root.renamed")
    span.end(T0 + 9)
    span.set_attribute("kb.late", 1)  # after the end: nothing
    span.add_event("kb.late", timestamp=T0 + 10)
    span.end(T0 + 11)  # twice: the first end holds
    return [span]


def test_a_root_span_with_attributes_events_and_a_new_name() -> None:
    sdk, lean = run_both(root)
    assert [s.name for s in sdk.spans] == ["kb.root.renamed"]
    assert_equal_runs(sdk, lean)


def remote_child(start: Start) -> list[trace.Span]:
    spans = [
        start("kb.child", context=remote(SAMPLED), attributes={"kb.x": 1}, start_time=T0),
        start("kb.stateful", context=remote(SAMPLED, TraceState([("kb", "1")])), start_time=T0),
    ]
    for span in spans:
        span.end(T0 + 5)
    return spans


def test_a_child_of_a_traceparent_keeps_its_trace_and_state() -> None:
    sdk, lean = run_both(remote_child)
    assert len(sdk.spans) == 2
    assert sdk.spans[0].parent is not None
    assert sdk.spans[0].parent.is_remote
    assert_equal_runs(sdk, lean)


def current_child(start: Start) -> list[trace.Span]:
    parent = start("kb.parent", start_time=T0)
    with current(parent):
        child = start("kb.child", kind=SpanKind.CLIENT, start_time=T0 + 1)
        child.end(T0 + 2)
    parent.end(T0 + 3)
    return [parent, child]


def test_a_child_of_the_current_span() -> None:
    sdk, lean = run_both(current_child)
    child = sdk.spans[0]
    assert child.parent is not None
    assert child.parent.span_id == sdk.spans[1].context.span_id
    assert_equal_runs(sdk, lean)


def linked(start: Start) -> list[trace.Span]:
    a = trace.get_current_span(remote(SAMPLED)).get_span_context()
    b = trace.get_current_span(remote(UNSAMPLED)).get_span_context()
    span = start(
        "kb.linked",
        links=[Link(a), Link(b, {"kb.why": "hint"}), Link(INVALID_SPAN_CONTEXT)],
        start_time=T0,
    )
    span.add_link(b)
    span.add_link(INVALID_SPAN_CONTEXT)  # nothing to say: no link
    span.add_link(INVALID_SPAN_CONTEXT, {"kb.why": "lost"})  # kept, as the SDK keeps it
    span.end(T0 + 1)
    return [span]


def test_links_given_at_the_start_and_added_later() -> None:
    sdk, lean = run_both(linked)
    assert len(sdk.spans[0].links) == 4
    assert_equal_runs(sdk, lean)


def unsampled(start: Start) -> list[trace.Span]:
    span = start("kb.unsampled", context=remote(UNSAMPLED), start_time=T0)
    with current(span):
        child = start("kb.unsampled.child", start_time=T0)
    child.end(T0 + 1)
    span.end(T0 + 2)
    return [span, child]


def test_an_unsampled_parent_exports_nothing_and_propagates_its_context() -> None:
    sdk, lean = run_both(unsampled)
    assert sdk.spans == []
    assert lean.spans == []
    for span in lean.returned:
        assert isinstance(span, NonRecordingSpan)
        assert span.get_span_context().trace_id == 0x1AF7651916CD43DD8448EB211C80319C
        assert not span.get_span_context().trace_flags.sampled
    assert_equal_runs(sdk, lean)


def roots(start: Start) -> list[trace.Span]:
    spans = [start(f"kb.root.{n}", start_time=T0 + n) for n in range(24)]
    for span in spans:
        span.end(T0 + 100)
    return spans


@pytest.mark.parametrize(
    "sampler", [TraceIdRatioBased(0.5), ParentBased(TraceIdRatioBased(0.5))], ids=repr
)
def test_a_trace_id_ratio_sampler_decides_alike(sampler: Sampler) -> None:
    sdk, lean = run_both(roots, sampler=sampler)
    assert 0 < len(sdk.spans) < 24  # some sampled, some not: the decision is tested
    assert_equal_runs(sdk, lean)


class Refused(Exception):
    code = "kb.refused"


def failed(start: Start) -> list[trace.Span]:
    failed = start("kb.failed", start_time=T0)
    mark_failed(failed, ConfigError("a message that may quote a document"))
    coded = start("kb.coded", start_time=T0)
    mark_failed(coded, Refused())
    ok = start("kb.ok", start_time=T0)
    ok.set_status(StatusCode.OK)
    ok.set_status(Status(StatusCode.ERROR))  # OK is final
    described = start("kb.described", start_time=T0)
    described.set_status(StatusCode.ERROR, "why")
    described.set_status(StatusCode.UNSET)  # changes nothing
    spans = [failed, coded, ok, described]
    for span in spans:
        span.end(T0 + 1)
    return spans


def test_a_failed_span_is_marked_alike() -> None:
    sdk, lean = run_both(failed)
    assert [s.status.status_code for s in sdk.spans] == [
        StatusCode.ERROR,
        StatusCode.ERROR,
        StatusCode.OK,
        StatusCode.ERROR,
    ]
    assert_equal_runs(sdk, lean)


def _crowded(start: Start) -> list[trace.Span]:
    linked = trace.get_current_span(remote(SAMPLED)).get_span_context()
    span = start(
        "kb.crowded",
        attributes={"kb.a": "abcdefgh", "kb.b": 1, "kb.c": ["x", "yz"], "kb.d": None},
        # Two links, not one twice: the SDK bounds a link's attributes in the caller's own
        # object, so one given twice loses its count of dropped attributes (the lean path
        # bounds a copy, and counts them each time).
        links=[Link(linked, {"p": 1, "q": 2}), Link(linked, {"p": 1, "q": 2})],
        start_time=T0,
    )
    span.set_attribute("kb.e", b"raw")
    span.set_attribute("", "no key")
    span.set_attributes({"kb.f": "long text", 7: "a key not text"})  # type: ignore[dict-item]
    span.set_attribute("kb.g", 1.5)
    span.set_attribute("kb.b", 2)
    for n in range(3):
        span.add_event(f"kb.event.{n}", {"p": n, "q": "long text"}, timestamp=T0 + n)
    span.end(T0 + 5)
    return [span]


@pytest.mark.parametrize(
    "limits",
    [
        SpanLimits(),
        SpanLimits(max_span_attributes=3, max_events=2, max_links=1, max_event_attributes=1),
        SpanLimits(max_attribute_length=4, max_link_attributes=1),
        SpanLimits(max_span_attributes=0, max_events=0, max_links=0),
    ],
    ids=["defaults", "counts", "lengths", "none"],
)
def test_attribute_values_and_limits_as_the_sdk_applies_them(limits: SpanLimits) -> None:
    sdk, lean = run_both(_crowded, limits=limits)
    assert_equal_runs(sdk, lean)


@pytest.mark.parametrize(
    "sampler",
    # The lean path answers the first four by their rule; the last is asked, as any other.
    [ALWAYS_ON, ALWAYS_OFF, DEFAULT_ON, DEFAULT_OFF, ParentBased(ALWAYS_ON)],
    ids=["always_on", "always_off", "parentbased_always_on", "parentbased_always_off", "asked"],
)
@pytest.mark.parametrize(
    "scenario", [root, remote_child, current_child, linked, unsampled, roots, failed, _crowded]
)
def test_every_case_under_the_standard_samplers(
    scenario: Callable[[Start], list[trace.Span]], sampler: Sampler
) -> None:
    assert_equal_runs(*run_both(scenario, sampler=sampler))


def test_the_standard_attribute_count_limit_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    sdk, lean = run_both(_crowded, limits=SpanLimits())
    assert len(lean.spans[0].attributes or {}) == 2
    assert lean.spans[0].dropped_attributes > 0
    assert_equal_runs(sdk, lean)


def test_the_services_spans_take_the_lean_path_and_keep_the_sdks_own_children() -> None:
    with traced() as exported:
        # An instrumentation's spans (the SDK's tracer) and ours parent each other through
        # the context: the request's server span, ours, an HTTP client's span.
        instrumentation = trace.get_tracer("kb-test")
        with (
            instrumentation.start_as_current_span("http.server") as server,
            span_under("kb.search", None, attributes={"kb.search.mode": "vector"}) as ours,
        ):
            assert isinstance(ours, LeanSpan)
            instrumentation.start_span("http.client").end()
        assert isinstance(start_span("kb.root", None, root=True), LeanSpan)
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert [spans["kb.search"].parent, spans["http.client"].parent] == [
        server.get_span_context(),
        ours.get_span_context(),
    ]


def test_a_tracer_counting_its_spans_keeps_the_sdks_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    provider = TracerProvider(shutdown_on_exit=False)
    counting = provider.get_tracer("kb-pipeline")
    assert not LeanTracer.covers(counting)
    monkeypatch.delenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED")
    assert LeanTracer.covers(TracerProvider(shutdown_on_exit=False).get_tracer("kb"))
    with traced():
        monkeypatch.setattr(kb_spans, "_kept", (trace.get_tracer_provider(), counting, None))
        span = start_span("kb.counted", None)
        assert not isinstance(span, LeanSpan)
        assert span.is_recording()
        span.end()


def test_a_disabled_tracer_returns_its_parents_context_alike() -> None:
    def disabled(start: Start) -> list[trace.Span]:
        span = start("kb.disabled", context=remote(SAMPLED), start_time=T0)
        span.end(T0 + 1)
        return [span]

    def disable(tracer: SdkTracer) -> None:
        tracer._set_tracer_config(_TracerConfig(is_enabled=False))

    sdk, lean = run_both(disabled, prepare=disable)
    assert lean.spans == []
    assert not lean.returned[0].is_recording()
    assert_equal_runs(sdk, lean)


@pytest.mark.parametrize(
    ("error", "escaped", "named"),
    [
        (ConfigError("a message that may quote a document"), False, "services.runtime.errors."),
        (ValueError("a message that may quote a document"), True, ""),
    ],
)
def test_an_exception_recorded_on_a_lean_span_keeps_only_its_type(
    error: Exception, escaped: bool, named: str
) -> None:
    """As the SDK's record_exception names it (module and qualified name, a builtin by its
    bare name, and whether it escaped), without its message and traceback."""
    with traced() as exported:
        span = start_span("kb.recorded", None)
        span.record_exception(error, escaped=escaped)
        span.end()
    (event,) = exported.get_finished_spans()[0].events
    expected = {
        "exception.type": named + type(error).__qualname__,
        "exception.escaped": str(escaped),
    }
    assert (event.name, dict(event.attributes or {})) == ("exception", expected)
    sdk_span = TracerProvider().get_tracer("kb.test").start_span("kb.recorded")
    sdk_span.record_exception(error, escaped=escaped)
    sdk_attributes = dict(sdk_span.events[0].attributes or {})  # type: ignore[attr-defined]
    assert {k: sdk_attributes[k] for k in expected} == expected
