"""The tracer every service takes its spans from, and what may go on a span.

Attributes follow the OpenTelemetry semantic conventions where one exists (``messaging.*``,
``db.*``; ``http.*`` comes from the ASGI instrumentation); ours are under ``kb.``. Tenant,
document, version and task ids go on spans (never on metrics: they are unbounded). Never a
document's text, a title, a principal, a query's text, a key, a token or a credential:
``tests/unit/runtime/test_tracing_content.py`` scans every exported attribute for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Final, TypedDict, Unpack

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from services.runtime.tracing.lean import LeanTracer
from services.runtime.tracing.propagation import context_of, span_context_of, traceparent_of

TRACER_NAME: Final = "kb-pipeline"

TENANT_ID: Final = "kb.tenant_id"
DOCUMENT_ID: Final = "kb.document_id"
VERSION_NUMBER: Final = "kb.version_number"
TASK_ID: Final = "kb.task_id"
LEASE_ATTEMPT: Final = "kb.lease_attempt"

Attributes = dict[str, AttributeValue]


def tracer() -> trace.Tracer:
    """The global provider's tracer: a process configures tracing after its modules are
    imported (a no-op tracer until then, and when it is off). Kept while the provider is
    the same one: the SDK's lookup costs a fifth of a span (it edits the warning filters
    each time)."""
    return _tracers()[0]


def _tracers() -> tuple[trace.Tracer, LeanTracer | None]:
    """The provider's tracer, and the lean path over it when it can take its spans
    (``lean.py``: what the SDK's span costs that ours need not)."""
    global _kept
    provider = trace.get_tracer_provider()
    kept = _kept
    if kept is not None and kept[0] is provider:
        return kept[1], kept[2]
    found = provider.get_tracer(TRACER_NAME)
    if isinstance(provider, trace.ProxyTracerProvider):
        # Tracing off (or not yet on): not kept, its tracer would keep the first real one
        # it met.
        return found, None
    lean = LeanTracer(found) if LeanTracer.covers(found) else None
    _kept = (provider, found, lean)
    return found, lean


_kept: tuple[trace.TracerProvider, trace.Tracer, LeanTracer | None] | None = None


def document_attributes(
    tenant_id: str, document_id: uuid.UUID | str, version_number: int | None = None
) -> Attributes:
    attributes: Attributes = {TENANT_ID: tenant_id, DOCUMENT_ID: str(document_id)}
    if version_number is not None:
        attributes[VERSION_NUMBER] = version_number
    return attributes


def annotate(attributes: Attributes) -> None:
    """Add ``attributes`` to the current span (what is known only once it runs)."""
    trace.get_current_span().set_attributes(attributes)


def mark(name: str) -> None:
    """An event on the current span: a step whose moment is worth seeing but not a span of
    its own (an event costs a tenth of a span to record and to export)."""
    trace.get_current_span().add_event(name)


def link_here() -> list[Link]:
    """A link to the current span, if there is one: from a span of another trace that it
    started (a bulk request's documents)."""
    context = trace.get_current_span().get_span_context()
    return [Link(context)] if context.is_valid else []


def link_current_to(contexts: Sequence[trace.SpanContext]) -> None:
    """Links from the current span to ``contexts``, the spans of batch steps its work went
    in (an embedding request): added once known, after the span started."""
    span = trace.get_current_span()
    for context in contexts:
        span.add_link(context)


def links_to(*traceparents: str | bytes | None) -> list[Link]:
    """Links to the spans these ``traceparent`` values name (the missing and malformed left
    out)."""
    contexts = (span_context_of(t) for t in traceparents)
    return [Link(context) for context in contexts if context is not None]


class SpanOptions(TypedDict, total=False):
    kind: SpanKind  # INTERNAL unless said
    attributes: Mapping[str, AttributeValue]
    links: Sequence[Link]
    start_time: int  # ns since the epoch; now unless said
    root: bool  # a trace of its own: no parent at all


def start_span(name: str, traceparent: str | bytes | None, **options: Unpack[SpanOptions]) -> Span:
    """A span, the child of the span ``traceparent`` names (of the current span when it
    names none; of none when ``root``), neither current nor ended: for a span whose end is
    elsewhere (an attempt, ended when its result is written). Exceptions are never
    recorded by the SDK (their messages may quote a document): ``mark_failed``."""
    context = Context() if options.get("root") else context_of(traceparent)
    sdk, lean = _tracers()
    if lean is not None:
        return lean.start_span(
            name,
            context,
            options.get("kind", SpanKind.INTERNAL),
            options.get("attributes"),
            options.get("links", ()),
            options.get("start_time"),
        )
    return sdk.start_span(
        name,
        context=context,
        kind=options.get("kind", SpanKind.INTERNAL),
        attributes=options.get("attributes"),
        links=options.get("links", ()),
        start_time=options.get("start_time"),
        record_exception=False,
        set_status_on_exception=False,
    )


def span_under(
    name: str, traceparent: str | bytes | None, **options: Unpack[SpanOptions]
) -> AbstractContextManager[Span]:
    """``start_span``'s span as the current one, ended on exit; an exception escaping it
    marks it failed, by its code or type alone (``mark_failed``)."""
    return _Current(name, traceparent, options)


class _Current(AbstractContextManager[Span]):
    """What ``trace.use_span`` does, without a generator and its exception handling: this
    runs several times for each document indexed, and three times for each search."""

    __slots__ = ("_name", "_options", "_span", "_token", "_traceparent")

    def __init__(self, name: str, traceparent: str | bytes | None, options: SpanOptions) -> None:
        self._name = name
        self._traceparent = traceparent
        self._options = options

    def __enter__(self) -> Span:
        span = self._span = start_span(self._name, self._traceparent, **self._options)
        self._token = otel_context.attach(trace.set_span_in_context(span))
        return span

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        span = self._span
        try:
            if error is not None:
                mark_failed(span, error)
        finally:
            # The context attached on entry must not outlive the span, nor the span stay
            # unended.
            otel_context.detach(self._token)
            span.end()


def mark_failed(span: Span, error: BaseException) -> None:
    """The span failed with ``error``: its stable code (or its type) as ``error.type`` and
    no message, no traceback (an error's message may quote the document)."""
    span.set_status(Status(StatusCode.ERROR))
    try:
        code = getattr(error, "code", None)
    except Exception:  # a property that raises: the type names the error then
        code = None
    span.set_attribute("error.type", code if isinstance(code, str) else type(error).__name__)


@contextmanager
def batch_span(
    name: str, traceparents: Sequence[str | None], attributes: Attributes
) -> Iterator[Span]:
    """One span, current while inside, for a step done once for several traces (a group
    commit): a child in the first of them that is sampled (of the first traced one when
    none is), so it is exported whenever one of its items is; none (a no-op span) when no
    item is traced. The items' own spans started inside link to it (``link_here``): a span
    per item cost as much as the step itself (BENCHMARKS.md#tracing-on-vs-off-issue-46)."""
    traced = [t for t in traceparents if t is not None]
    if not traced:
        yield trace.INVALID_SPAN
        return
    sampled = (t for t in traced if _sampled(t))
    with span_under(name, next(sampled, traced[0]), attributes=attributes) as span:
        yield span


def _sampled(traceparent: str) -> bool:
    context = span_context_of(traceparent)
    return context is not None and context.trace_flags.sampled


class SpansUnder:
    """One span per item of a batch that serves several traces at once (the switches a
    group commit writes: each is its own document's step, and its event continues from
    it): each under its own item's ``traceparent``, none for an item without one, all
    started together (with the same ``links``) and each ended with its own outcome."""

    def __init__(
        self,
        name: str,
        traceparents: Sequence[str | None],
        attributes: Attributes,
        links: Sequence[Link] = (),
    ) -> None:
        self.spans: list[Span | None] = [
            None if t is None else start_span(name, t, attributes=attributes, links=links)
            for t in traceparents
        ]

    def traceparent(self, at: int) -> str | None:
        """The ``traceparent`` of item ``at``'s span (None: it has none)."""
        span = self.spans[at]
        return None if span is None else traceparent_of(span.get_span_context())

    def end(
        self,
        errors: Sequence[BaseException | None] = (),
        attributes: Sequence[Attributes] = (),
    ) -> None:
        for at, span in enumerate(self.spans):
            if span is None:
                continue
            if at < len(attributes):
                span.set_attributes(attributes[at])
            error = errors[at] if at < len(errors) else None
            if error is not None:
                mark_failed(span, error)
            span.end()
