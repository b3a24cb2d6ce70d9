"""The relay's producer spans: one per outbox row that carries a trace context, the child of
the span that wrote the row (a publish, a switch), named and described as the messaging
semantic conventions say (``send <topic>``, ``messaging.*``). Its context goes out as the
message's ``traceparent`` header, so the consumer continues the same trace.

A row without a trace context (written while its writer did not trace) costs nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import Span, SpanKind

from services.relay.ports import OutboxRecord
from services.runtime.tracing.propagation import traceparent_of
from services.runtime.tracing.spans import TENANT_ID, mark_failed, start_span


class SendSpans:
    """The spans of one batch sent: started as each record is handed to the producer,
    ended when Kafka acknowledged it (or the batch failed)."""

    def __init__(self, *, replay: bool) -> None:
        self._replay = replay
        self._spans: list[Span | None] = []

    def start(self, record: OutboxRecord, topic: str) -> str | None:
        """Start ``record``'s span; the ``traceparent`` header to send with it (the span's,
        or the row's own when this process does not trace; None: the row has none)."""
        if record.traceparent is None:
            self._spans.append(None)
            return None
        span = start_span(
            f"send {topic}",
            record.traceparent,
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": topic,
                "messaging.message.id": str(record.event_id),
                "messaging.kafka.message.key": record.aggregate_key,
                TENANT_ID: record.tenant_id,
                "kb.event_type": record.event_type,
                "kb.outbox.position": record.position,
                "kb.replay": self._replay,
            },
        )
        self._spans.append(span)
        return traceparent_of(span.get_span_context()) or record.traceparent

    def end(self, results: Sequence[Any]) -> None:
        """End each span with its record's acknowledgement (partition and offset) or
        failure."""
        for span, result in zip(self._spans, results, strict=False):
            if span is None:
                continue
            if isinstance(result, BaseException):
                mark_failed(span, result)
            else:
                span.set_attribute("messaging.destination.partition.id", str(result.partition))
                span.set_attribute("messaging.kafka.offset", result.offset)
            span.end()
        self._spans.clear()

    def fail(self, error: BaseException) -> None:
        """The batch was given up before every record was acknowledged."""
        for span in self._spans:
            if span is not None:
                mark_failed(span, error)
                span.end()
        self._spans.clear()
