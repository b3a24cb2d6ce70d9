"""What a span costs the indexer, by the work done for it rather than by time: the SDK's
tracer lookup once per provider, each stored ``traceparent`` parsed once, the resource
hashed once (the OTLP encoder groups every span by it), and the steps that are moments
recorded as events on the attempt rather than spans of their own, and a step done once for
a batch of documents (a group commit) one span that each document's span links to."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk import resources
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.runtime.tracing import propagation
from services.runtime.tracing.propagation import context_of, span_context_of, traceparent_of
from services.runtime.tracing.setup import _HashedOnce
from services.runtime.tracing.spans import SpansUnder, batch_span, link_here, mark, span_under
from tests.support.tracing import linked_span_ids, named, one, parent_id, span_id, trace_id, traced

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_spans_look_their_tracer_up_once_per_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    with traced():
        provider = trace.get_tracer_provider()
        lookups: list[str] = []
        look_up = provider.get_tracer

        def counted(name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
            lookups.append(name)
            return look_up(name, *args, **kwargs)

        monkeypatch.setattr(provider, "get_tracer", counted)
        for _ in range(3):
            with span_under("kb.index.parse_and_chunk", TRACEPARENT):
                pass
        assert lookups == ["kb-pipeline"]
    # Another provider (tracing on again in a test) is looked up anew, and none is kept
    # while tracing is off.
    with span_under("kb.off", None) as off:
        assert not off.is_recording()
    with traced() as exported, span_under("kb.on", None):
        pass
    assert [s.name for s in exported.get_finished_spans()] == ["kb.on"]


def test_a_traceparent_is_parsed_once_and_the_parsed_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(propagation, "_read", {})
    parses: list[object] = []
    extract = propagation._W3C.extract

    def counted(carrier: Any, *args: Any, **kwargs: Any) -> Any:
        parses.append(carrier)
        return extract(carrier, *args, **kwargs)

    monkeypatch.setattr(propagation._W3C, "extract", counted)
    first = context_of(TRACEPARENT)
    assert context_of(TRACEPARENT) is first
    assert context_of(TRACEPARENT.encode()) is first
    assert context_of("garbage") is None
    assert span_context_of("garbage") is None
    assert len(parses) == 2  # the good one once, the bad one once
    monkeypatch.setattr(propagation, "_READ_CAPACITY", 2)
    for n in range(5):
        context_of(f"00-0af7651916cd43dd8448eb211c80319c-{n + 1:016x}-01")
        assert len(propagation._read) <= 2


@pytest.mark.parametrize("flags", [TraceFlags.SAMPLED, TraceFlags.DEFAULT])
def test_a_traceparent_is_written_as_the_w3c_propagator_writes_it(flags: int) -> None:
    context = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, TraceFlags(flags)
    )
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(
        carrier, context=trace.set_span_in_context(NonRecordingSpan(context))
    )
    assert traceparent_of(context) == carrier["traceparent"]


def test_the_resource_is_hashed_once_and_equals_the_sdks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attributes = {"service.name": "kb-indexer", "service.version": "1"}
    resource = _HashedOnce.of(Resource.create(attributes))
    assert resource == Resource.create(attributes)
    assert hash(resource) == hash(Resource.create(attributes))

    def no_json(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("the resource was serialised again")

    monkeypatch.setattr(resources, "dumps", no_json)
    assert {resource: 1}[resource] == 1


def test_a_moment_is_an_event_on_the_current_span() -> None:
    with traced() as exported:
        with span_under("kb.index.attempt", TRACEPARENT):
            mark("kb.index.loaded")
        mark("kb.nowhere")  # no span: nothing, and no error
    attempt = one(exported.get_finished_spans(), "kb.index.attempt")
    assert [event.name for event in attempt.events] == ["kb.index.loaded"]


UNSAMPLED = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"


def test_a_step_done_once_for_a_batch_is_one_span_its_items_spans_link_to() -> None:
    items = [
        None,
        UNSAMPLED,
        TRACEPARENT,
        "00-2af7651916cd43dd8448eb211c80319c-d7ad6b71692033a1-01",
    ]
    with traced() as exported:
        with batch_span("kb.index.group_commit", items, {"db.operation.batch.size": 4}):
            switches = SpansUnder("kb.index.switch", items, {}, links=link_here())
            switches.end()
        with batch_span("kb.untraced", [None, None], {}) as none:
            assert not none.is_recording()
        spans = exported.get_finished_spans()
    group = one(spans, "kb.index.group_commit")  # one, not one per item
    # In the first sampled item's trace (the unsampled one's would not be exported).
    assert (trace_id(group), parent_id(group)) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
    )
    switched = named(spans, "kb.index.switch")
    assert len(switched) == 2  # the sampled items': none for the untraced, the unsampled dropped
    for switch in switched:
        assert linked_span_ids(switch) == [span_id(group)]
    assert {s.name for s in spans} == {"kb.index.group_commit", "kb.index.switch"}
