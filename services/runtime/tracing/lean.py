"""A cheaper path for the spans the services make themselves, beside the SDK's.

The SDK's span is general: a lock and a type check for every attribute, several locks and
bounded lists built at its start, the whole span copied when it ends. Our spans are used by
one task each, and their attributes are ours, of plain types, so a ``LeanSpan`` keeps them
in a dict and builds what the SDK would only where it is needed: a value of another type,
a limit reached, a length limit set. What it takes from the provider's tracer is all the
SDK's own: sampler, id generator, resource, instrumentation scope, span limits and span
processor; at its end the processor receives one SDK ``ReadableSpan`` with the fields the
SDK's span would have handed it (``tests/unit/tracing/test_lean_spans.py`` exports both
and compares them, field by field and as OTLP bytes).

Where the lean path is not the SDK's: a lean span is one task's (no locks: two threads
ending one span at once could both export it), and misuse (a change after the end, an end
twice) is ignored without the SDK's warning. It never records an exception by itself:
``spans.mark_failed`` says what failed. A tracer the lean path cannot reproduce (the SDK's
internal metrics on) is used as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from time import time_ns
from types import MappingProxyType
from typing import Any, Final, TypeGuard, TypeVar, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON, Decision, Sampler
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.util.types import AttributeValue

# The types kept as given: what the SDK's attribute cleaning returns unchanged when no
# length limit is set. Anything else goes through the SDK's cleaning.
_PLAIN: Final = frozenset({str, bool, int, float})
_TEXT: Final = frozenset({str})
_UNSET: Final = Status(StatusCode.UNSET)
# What the SDK gives an event or a link without attributes, one shared (it is immutable).
_NONE: Final = BoundedAttributes(immutable=True)
_T = TypeVar("_T")
_SAMPLED: Final = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED: Final = TraceFlags(TraceFlags.DEFAULT)


class LeanTracer:
    """Starts spans as ``sdk`` (the provider's tracer) would, through the lean span."""

    def __init__(self, sdk: SdkTracer) -> None:
        self.sdk = sdk

    @staticmethod
    def covers(sdk: trace.Tracer) -> TypeGuard[SdkTracer]:
        """Whether the lean path reproduces ``sdk``'s spans: an SDK tracer whose internal
        metrics are off (each span would be counted at its start and end)."""
        return isinstance(sdk, SdkTracer) and isinstance(
            getattr(sdk, "_tracer_metrics", None), NoOpTracerMetrics
        )

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] = (),
        start_time: int | None = None,
    ) -> trace.Span:
        """What ``Tracer.start_span`` does, decisions and all, with a ``LeanSpan``."""
        sdk = self.sdk
        # Read once: the sampler and the processors would each read it again.
        context = context if context is not None else otel_context.get_current()
        found = trace.get_current_span(context).get_span_context()
        if not sdk._is_enabled():
            return trace.NonRecordingSpan(found)
        ids = sdk.id_generator
        parent = found if found.is_valid else None
        if parent is None:
            trace_id = ids.generate_trace_id()
            random_trace_id = ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random_trace_id = parent.trace_flags.random_trace_id
        decision, attributes, state = _sampled(
            sdk.sampler, context, parent, trace_id, name, kind, attributes, links
        )
        flags = _SAMPLED if decision is Decision.RECORD_AND_SAMPLE else _NOT_SAMPLED
        if random_trace_id:
            flags = TraceFlags(flags | TraceFlags.RANDOM_TRACE_ID)
        span_context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=flags,
            trace_state=state,
        )
        if decision is Decision.DROP:
            return trace.NonRecordingSpan(span_context)
        span = LeanSpan(sdk, name, span_context, parent, kind, attributes, links)
        span._start_time = start_time if start_time is not None else time_ns()
        sdk.span_processor.on_start(span, parent_context=context)  # type: ignore[arg-type]
        return span


def _sampled(
    sampler: Sampler,
    context: Context,
    parent: SpanContext | None,
    trace_id: int,
    name: str,
    kind: SpanKind,
    attributes: Mapping[str, AttributeValue] | None,
    links: Sequence[Link],
) -> tuple[Decision, Mapping[str, AttributeValue], TraceState | None]:
    """The sampler's decision, the span's attributes and its trace state. The SDK's two
    fixed samplers (``always_on``, and ``parentbased_always_on``, the default) are answered
    here by their rule, as they answer: asking them costs a tenth of a span."""
    if sampler is ALWAYS_ON or sampler is DEFAULT_ON:
        state = parent.trace_state if parent is not None else None
        if sampler is ALWAYS_ON or parent is None or parent.trace_flags.sampled:
            return Decision.RECORD_AND_SAMPLE, attributes or _NONE, state
        return Decision.DROP, _NONE, state
    result = sampler.should_sample(context, trace_id, name, kind, attributes, links)
    return result.decision, result.attributes, result.trace_state


class LeanSpan(trace.Span, ReadableSpan):
    """An SDK span's behaviour for one task's span; a ``ReadableSpan`` while it runs too,
    as the SDK's is (what a processor's ``on_start`` reads)."""

    def __init__(
        self,
        sdk: SdkTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Mapping[str, AttributeValue],
        links: Sequence[Link],
    ) -> None:
        limits: SpanLimits = sdk._span_limits
        self._limits = limits
        self._processor = sdk.span_processor
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._resource = sdk.resource
        self._instrumentation_info = sdk.instrumentation_info
        self._instrumentation_scope = sdk._instrumentation_scope
        self._start_time: int | None = None
        self._end_time: int | None = None
        self._status = _UNSET
        self._room = _room(limits.max_span_attributes)
        self._attributes: dict[str, Any] | BoundedAttributes = {}
        if limits.max_span_attribute_length is not None:
            self._attributes = self._bounded()
        self.set_attributes(attributes)
        self._events: list[Event] | BoundedList[Event] = []
        self._links: list[Link] | BoundedList[Link] = []
        for link in links:
            self._add_link(link.context, link.attributes)

    def get_span_context(self) -> SpanContext:
        return cast(SpanContext, self._context)

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is not None:
            return
        if not self._set_plain(key, value):
            self._bounded()[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end_time is not None:
            return
        kept = self._attributes
        if (
            type(kept) is dict
            and _PLAIN.issuperset(map(type, attributes.values()))
            and _TEXT.issuperset(map(type, attributes))
            and "" not in attributes
            and len(kept) + len(attributes) <= self._room
        ):
            # The SDK moves a key set again to the end (the oldest is dropped first).
            for key in attributes:
                kept.pop(key, None)
            kept.update(attributes)
        elif attributes:
            # All at once, as the SDK cleans a mapping (a key that is not text is named by
            # its text, not dropped as a single one is).
            self._bounded()._set_items(attributes)

    def _set_plain(self, key: str, value: Any) -> bool:
        """Whether ``value`` was kept as it is: a plain value under a plain key, with room
        for it, and no length limit."""
        attributes = self._attributes
        if (
            type(attributes) is not dict
            or type(key) is not str
            or not key
            or type(value) not in _PLAIN
            or (key not in attributes and len(attributes) >= self._room)
        ):
            return False
        # The SDK moves a key set again to the end (the oldest is dropped first).
        attributes.pop(key, None)
        attributes[key] = value
        return True

    def _bounded(self) -> BoundedAttributes:
        """The attributes as the SDK keeps them, from now on: what is needed beyond plain
        values under the limits."""
        if isinstance(self._attributes, BoundedAttributes):
            return self._attributes
        limits = self._limits
        self._attributes = BoundedAttributes(
            limits.max_span_attributes,
            self._attributes,
            immutable=False,
            max_value_len=limits.max_span_attribute_length,
        )
        return self._attributes

    def add_event(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
    ) -> None:
        if self._end_time is not None:
            return
        limits = self._limits
        kept = (
            BoundedAttributes(
                limits.max_event_attributes,
                attributes,
                immutable=True,
                max_value_len=limits.max_attribute_length,
            )
            if attributes
            else _NONE
        )
        self._events = _appended(self._events, Event(name, kept, timestamp), limits.max_events)

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end_time is None:
            self._add_link(context, attributes)

    def _add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None) -> None:
        # The SDK's test: an invalid context is a link only with something to say.
        if not (context and (context.is_valid or attributes or context.trace_state)):
            return
        limits = self._limits
        kept = (
            BoundedAttributes(
                limits.max_link_attributes,
                attributes,
                immutable=True,
                max_value_len=limits.max_attribute_length,
            )
            if attributes
            else _NONE
        )
        self._links = _appended(self._links, Link(context, kept), limits.max_links)

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """As the SDK: OK is final, UNSET changes nothing."""
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The exception's type named as the SDK names it, and whether it escaped; never
        its message nor its traceback, which may quote a document."""
        kind = type(exception)
        module = kind.__module__
        named = (
            f"{module}.{kind.__qualname__}"
            if module and module != "builtins"
            else kind.__qualname__
        )
        recorded = {
            "exception.type": named,
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time if end_time is not None else time_ns()
        attributes = self._attributes
        # By its type: an isinstance against an ABC costs a lookup each time.
        if type(attributes) is dict:
            kept: Mapping[str, Any] = MappingProxyType(attributes)
        else:
            kept = cast(BoundedAttributes, attributes)
            kept._immutable = True  # what the SDK's end does
        processor = self._processor
        processor._on_ending(self)  # type: ignore[arg-type]
        # Positionally, in the order of ReadableSpan's parameters (the contract test
        # compares every field with the SDK's).
        readable = ReadableSpan(
            self._name, self._context, self._parent, self._resource, kept,
            _frozen(self._events), _frozen(self._links), self._kind,
            self._instrumentation_info, self._status, self._start_time, self._end_time,
            self._instrumentation_scope
        )  # fmt: skip
        processor.on_end(readable)


def _room(limit: int | None) -> int:
    return limit if limit is not None else 1 << 62


def _appended(
    items: list[_T] | BoundedList[_T], item: _T, limit: int | None
) -> list[_T] | BoundedList[_T]:
    """``items`` with ``item`` at the end: a list while under ``limit``, then the SDK's
    bounded list (the oldest dropped, and counted)."""
    if type(items) is list and len(items) < _room(limit):
        items.append(item)
        return items
    if type(items) is list:
        items = BoundedList.from_seq(limit, items)
    items.append(item)
    return items


def _frozen(items: list[_T] | BoundedList[_T]) -> Sequence[_T]:
    if type(items) is list:
        return tuple(items) if items else ()
    return items
