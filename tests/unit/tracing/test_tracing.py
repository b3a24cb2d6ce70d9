"""Tracing's rules at the unit level, spans exported to memory: off unless configured, the
W3C context read and written, log lines carrying ids, an attempt's span continuing the
publish's trace (one trace for every attempt, linked to the hint that woke its claim), the
relay's producer spans and the header they put on a message."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from opentelemetry.trace import SpanKind

from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Vectors
from services.indexer.ports import IndexingOutcome
from services.indexer.queue.attempt import RunOnceResult
from services.indexer.queue.hints import HintConsumer, HintMessage
from services.indexer.queue.worker import Worker
from services.indexer.task import Lease
from services.relay.ports import OutboxRecord
from services.relay.send_spans import SendSpans
from services.relay.sink_kafka import headers_for
from services.runtime.errors import ConfigError, DatabaseBusy
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import INDEX_TASK_CREATED
from services.runtime.tracing.logs import add_trace_ids
from services.runtime.tracing.propagation import (
    current_traceparent,
    span_context_of,
    traceparent_of,
)
from services.runtime.tracing.setup import tracing_config
from services.runtime.tracing.spans import span_under, tracer
from services.search.searcher import Searcher, SearchMode, SearchRequest
from tests.fakes.search_index import DIMENSION, FakeIndex
from tests.fakes.task_queue import InMemoryTaskQueue, InMemoryTransaction
from tests.support.clock import ManualClock
from tests.support.tracing import (
    every_recorded_text,
    linked_span_ids,
    named,
    one,
    parent_id,
    span_id,
    trace_id,
    traced,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("environ", "enabled", "protocol"),
    [
        ({}, False, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True, "http/protobuf"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True, "http/protobuf"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True, "http/protobuf"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            True,
            "grpc",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"},
            False,
            None,
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
            False,
            None,
        ),
    ],
)
def test_tracing_is_off_unless_an_exporter_is_configured(
    environ: dict[str, str], enabled: bool, protocol: str | None
) -> None:
    config = tracing_config(environ)
    assert config.enabled is enabled
    if protocol is not None:
        assert config.protocol == protocol


@pytest.mark.parametrize(
    "environ",
    [
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
        },
        {"OTEL_TRACES_EXPORTER": "zipkin"},
    ],
)
def test_what_cannot_be_exported_stops_the_start(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        tracing_config(environ)


def test_off_there_is_no_context_to_store_and_no_ids_in_logs() -> None:
    with tracer().start_as_current_span("nothing"):
        assert current_traceparent() is None
        assert add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}


def test_a_traceparent_round_trips_and_a_bad_one_is_ignored() -> None:
    context = span_context_of(TRACEPARENT)
    assert context is not None
    assert format(context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert traceparent_of(context) == TRACEPARENT
    assert span_context_of(TRACEPARENT.encode()) == context
    for bad in (None, "", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01", b"\xff"):
        assert span_context_of(bad) is None


def test_log_lines_carry_the_ids_of_the_current_span() -> None:
    with traced(), span_under("kb.publish", TRACEPARENT):
        event = add_trace_ids(None, "info", {"event": "version.published"})
        line = structlog.processors.JSONRenderer()(None, "info", dict(event))
    assert event["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert len(str(event["span_id"])) == 16
    assert event["span_id"] != "b7ad6b7169203331"  # the child's own, not its parent's
    assert "0af7651916cd43dd8448eb211c80319c" in line


class _UnreadableCode(Exception):
    @property
    def code(self) -> str:
        raise RuntimeError("the code cannot be read")


def test_a_span_whose_failure_cannot_be_marked_still_ends_and_leaves_the_context() -> None:
    """An error whose ``code`` property raises: mark_failed names it by its type instead of
    raising (every caller of it, a span's exit or a batch's, goes on), the application's
    error propagates, and the context attached on entry is detached and the span ended."""
    with traced() as exported:
        before = current_traceparent()
        with (
            pytest.raises(_UnreadableCode) as raised,
            span_under("kb.publish", TRACEPARENT),
        ):
            raise _UnreadableCode
        assert raised.value.__context__ is None
        assert current_traceparent() == before
        assert [span.name for span in exported.get_finished_spans()] == ["kb.publish"]
        (span,) = exported.get_finished_spans()
        assert span.attributes is not None
        assert span.attributes["error.type"] == "_UnreadableCode"


class _Traced(InMemoryTaskQueue):
    """Claims hand out leases carrying the publish's context, as the task row does."""

    async def claim(
        self, tier: str, owner: str, *, lease_seconds: float, limit: int = 1
    ) -> list[Lease]:
        leases = await super().claim(tier, owner, lease_seconds=lease_seconds, limit=limit)
        return [replace(lease, traceparent=TRACEPARENT) for lease in leases]


class _Indexes:
    """Records the lease it indexed and the trace context current while it ran."""

    def __init__(self) -> None:
        self.seen: list[tuple[Lease, str | None]] = []

    async def index(self, lease: Lease) -> IndexingOutcome:
        with span_under("kb.index.parse_and_chunk", None):
            self.seen.append((lease, current_traceparent()))

        async def write(tx: object) -> None:
            assert isinstance(tx, InMemoryTransaction)

        return IndexingOutcome(write=write)


def _worker(queue: InMemoryTaskQueue, indexer: Any) -> Worker:
    return Worker(queue, indexer, tier="standard", owner="w1", lease_seconds=30)


async def test_an_attempt_continues_the_publish_trace_with_its_steps_as_children() -> None:
    queue = _Traced()
    task = queue.new_task()
    indexer = _Indexes()
    with traced() as exported:
        assert await _worker(queue, indexer).run_once() is RunOnceResult.SUCCEEDED
        spans = exported.get_finished_spans()

    publish = span_context_of(TRACEPARENT)
    assert publish is not None
    attempt = one(spans, "kb.index.attempt")
    assert trace_id(attempt) == publish.trace_id
    assert parent_id(attempt) == publish.span_id
    assert attempt.attributes is not None
    assert attempt.attributes["kb.task_id"] == str(task.task_id)
    assert attempt.attributes["kb.lease_attempt"] == 1
    assert attempt.attributes["kb.claim.woken_by"] == "poll"
    assert attempt.attributes["kb.attempt.result"] == "SUCCEEDED"
    assert attempt.links == ()
    for child in ("kb.index.claim", "kb.index.parse_and_chunk"):
        assert parent_id(one(spans, child)) == span_id(attempt), child
    # Handed to the group commit: an event on the attempt, not a span of its own.
    assert [event.name for event in attempt.events] == ["kb.index.commit_queued"]
    claim = one(spans, "kb.index.claim")
    assert claim.start_time is not None
    assert attempt.start_time is not None
    assert claim.start_time == attempt.start_time  # the claim began the attempt
    # What the attempt writes continues from its span: the lease it indexes carries it.
    ((lease, current),) = indexer.seen
    carried, inside = span_context_of(lease.traceparent), span_context_of(current)
    assert carried is not None
    assert carried.span_id == span_id(attempt)
    assert inside is not None  # the parse's own span, the attempt's child
    assert inside.span_id != span_id(attempt)


async def test_every_attempt_of_a_task_is_in_the_same_trace() -> None:
    clock = ManualClock()
    queue = _Traced(clock)
    queue.new_task()

    class FailsOnce(_Indexes):
        async def index(self, lease: Lease) -> IndexingOutcome:
            if not self.seen:
                self.seen.append((lease, None))
                raise DatabaseBusy("the database is busy")  # retriable: RETRY_WAIT
            return await super().index(lease)

    with traced() as exported:
        worker = _worker(queue, FailsOnce())
        assert await worker.run_once() is RunOnceResult.FAILED
        clock.advance(3600)
        assert await worker.run_once() is RunOnceResult.SUCCEEDED
        spans = exported.get_finished_spans()
    first, second = named(spans, "kb.index.attempt")
    assert first.attributes is not None
    assert second.attributes is not None
    assert (first.attributes["kb.lease_attempt"], second.attributes["kb.lease_attempt"]) == (1, 2)
    assert first.attributes["kb.attempt.result"] == "FAILED"
    assert first.attributes["error.type"] == "DATABASE_BUSY"
    assert second.attributes["kb.attempt.result"] == "SUCCEEDED"
    publish = span_context_of(TRACEPARENT)
    assert publish is not None
    for attempt in (first, second):
        assert (trace_id(attempt), parent_id(attempt)) == (publish.trace_id, publish.span_id)


def _hint(task_id: uuid.UUID, traceparent: bytes) -> HintMessage:
    payload = default_registry().encode(
        INDEX_TASK_CREATED,
        {
            "eventId": uuid.uuid4(),
            "tenantId": "acme",
            "tier": "standard",
            "documentId": uuid.uuid4(),
            "versionNumber": 1,
            "taskId": task_id,
            "taskType": "INDEX_VERSION",
            "occurredAt": datetime.now(UTC),
        },
    )
    return HintMessage(
        payload, {"event_type": INDEX_TASK_CREATED.encode(), "traceparent": traceparent}
    )


async def test_an_attempt_woken_by_its_hint_links_to_the_message() -> None:
    queue = _Traced()
    task = queue.new_task()
    worker = _worker(queue, _Indexes())
    sent = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
    hints = HintConsumer(
        tier="standard", wake=worker.wake, connect=_never, contexts=worker.hint_contexts
    )
    assert hints.handle([_hint(task.task_id, sent.encode())])
    with traced() as exported:
        assert await worker.run_once() is RunOnceResult.SUCCEEDED
        spans = exported.get_finished_spans()
    attempt = one(spans, "kb.index.attempt")
    assert attempt.attributes is not None
    assert attempt.attributes["kb.claim.woken_by"] == "hint"
    assert linked_span_ids(attempt) == [int("00f067aa0ba902b7", 16)]


def _never() -> Any:
    raise AssertionError("the test hands the consumer its messages")


def _record(traceparent: str | None) -> OutboxRecord:
    return OutboxRecord(
        position=7,
        event_id=uuid.uuid4(),
        event_type=INDEX_TASK_CREATED,
        tenant_id="acme",
        tier="standard",
        aggregate_key="acme/doc",
        payload=b"secret body",
        created_at=datetime.now(UTC),
        traceparent=traceparent,
    )


def test_the_relay_sends_under_a_producer_span_and_passes_its_context_on() -> None:
    with traced() as exported:
        spans = SendSpans(replay=False)
        header = spans.start(_record(TRACEPARENT), "kb.index-hints.standard")
        assert spans.start(_record(None), "kb.index-hints.standard") is None
        spans.end([SimpleNamespace(partition=3, offset=41), SimpleNamespace(partition=0, offset=1)])
        (send,) = exported.get_finished_spans()
    assert send.name == "send kb.index-hints.standard"
    assert send.kind is SpanKind.PRODUCER
    publish = span_context_of(TRACEPARENT)
    assert publish is not None
    assert (trace_id(send), parent_id(send)) == (publish.trace_id, publish.span_id)
    assert send.attributes is not None
    assert send.attributes["messaging.system"] == "kafka"
    assert send.attributes["messaging.destination.name"] == "kb.index-hints.standard"
    assert send.attributes["messaging.destination.partition.id"] == "3"
    assert send.attributes["messaging.kafka.offset"] == 41
    context = span_context_of(header)
    assert context is not None
    assert context.span_id == span_id(send)
    headers = dict(headers_for(_record(TRACEPARENT), replay=False, traceparent=header))
    assert headers["traceparent"] == str(header).encode()


def test_a_relay_that_does_not_trace_still_passes_the_stored_context_on() -> None:
    spans = SendSpans(replay=False)
    assert spans.start(_record(TRACEPARENT), "kb.document-events") == TRACEPARENT
    spans.end([SimpleNamespace(partition=0, offset=0)])
    assert "traceparent" not in dict(headers_for(_record(None), replay=False))


class _ProviderDown(HashingEmbedder):
    async def embed(self, texts: Sequence[str]) -> Vectors:
        raise IndexingFailed(ErrorCode.EMBEDDING_UNAVAILABLE, f"provider says no to {texts[0]}")


@pytest.mark.parametrize("embedder", [HashingEmbedder(DIMENSION), _ProviderDown(DIMENSION)])
async def test_a_search_has_its_steps_as_spans_and_never_its_query_or_principals(
    embedder: HashingEmbedder,
) -> None:
    query, principal = "whisper-falcon-9931 refund", "group:night-shift"
    request = SearchRequest("acme", query, (principal,), 5, SearchMode.HYBRID)
    with traced() as exported:
        result = await Searcher(embedder, FakeIndex()).search(request)
        spans = exported.get_finished_spans()
    search = one(spans, "kb.search")
    assert search.attributes is not None
    assert search.attributes["kb.tenant_id"] == "acme"
    embed = one(spans, "kb.search.embed_query")
    assert parent_id(embed) == span_id(search)
    fused = [parent_id(s) for s in named(spans, "kb.search.fuse")]
    if result.degraded is not None:
        assert search.attributes["kb.search.degraded"] == "keyword-only"
        assert embed.attributes is not None
        assert embed.attributes["error.type"] == ErrorCode.EMBEDDING_UNAVAILABLE
        assert fused == []  # the keyword list alone: nothing fused
    else:
        assert "kb.search.degraded" not in search.attributes
        assert fused == [span_id(search)]
    assert search.attributes["kb.search.results"] == len(result.results)
    recorded = every_recorded_text(spans)
    for secret in (query, "whisper-falcon", principal, "provider says no"):
        assert secret not in recorded


@pytest.mark.parametrize("mode", [SearchMode.VECTOR, SearchMode.KEYWORD])
async def test_a_search_of_one_list_has_no_fusion_span(mode: SearchMode) -> None:
    request = SearchRequest("acme", "refund", ("group:all",), 5, mode)
    with traced() as exported:
        await Searcher(HashingEmbedder(DIMENSION), FakeIndex()).search(request)
        spans = exported.get_finished_spans()
    expected = {"kb.search", "kb.search.embed_query"} if mode.uses_vector else {"kb.search"}
    assert {s.name for s in spans} == expected  # FakeIndex reads its lists without spans
