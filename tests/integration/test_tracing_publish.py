"""A publish's trace context is stored with what it writes (the index task and the outbox
rows, migration 0034): the API's request, its publish span and the stored context are one
trace; a bulk request's documents each start a trace of their own, linked to the request;
nothing of a document's content, title, principals or the key is recorded; tracing off,
nothing is stored."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest
from opentelemetry.trace import SpanKind

from services.runtime.settings import RuntimeSettings
from services.runtime.tracing.propagation import span_context_of
from tests.support.api import ApiTenant, add_tenant, publish, publisher_harness, upload
from tests.support.tracing import (
    ancestors,
    every_recorded_text,
    linked_span_ids,
    named,
    one,
    span_id,
    trace_id,
    traced,
)

pytestmark = pytest.mark.integration

MARKER = "zebra-quartz-7781 refunds within thirty days"
TITLE = "Confidential merger memo"
PRINCIPAL = "group:board-secret"


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


async def _stored(conn: asyncpg.Connection[Any], document_id: str) -> set[str | None]:
    rows = await conn.fetch(
        "SELECT traceparent FROM index_task WHERE document_id = $1"
        " UNION ALL SELECT traceparent FROM outbox WHERE aggregate_key LIKE $2",
        uuid.UUID(document_id),
        f"%/{document_id}",
    )
    return {row["traceparent"] for row in rows}


async def test_a_publish_stores_its_span_with_the_task_and_the_events(
    settings: RuntimeSettings, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    with traced() as exported:
        async with publisher_harness(settings) as api:
            created = await upload(api.client, acme, MARKER.encode(), title=TITLE)
            assert created.status_code == 201, created.text
            document_id = created.json()["documentId"]
            published = await publish(api.client, acme, document_id, 1, 1, read=[PRINCIPAL])
            assert published.status_code == 202, published.text
        spans = exported.get_finished_spans()

    span = one(spans, "kb.publish")
    assert span.attributes is not None
    assert span.attributes["kb.document_id"] == document_id
    assert span.attributes["kb.tenant_id"] == "acme"
    assert span.attributes["kb.version_number"] == 1
    # The publish is under the request's server span (the ASGI instrumentation).
    (server,) = [s for s in ancestors(spans, span) if s.kind is SpanKind.SERVER]
    assert server.attributes is not None
    assert str(server.attributes["http.route"]).endswith("/publish")

    stored = await _stored(conn, document_id)
    assert len(stored) == 1  # the task and both events: one context, the publish's
    (traceparent,) = stored
    context = span_context_of(traceparent)
    assert context is not None
    assert (context.trace_id, context.span_id) == (trace_id(span), span_id(span))

    recorded = every_recorded_text(spans)
    for secret in (MARKER, "zebra-quartz", TITLE, PRINCIPAL, acme.key, acme.key.split(".")[-1]):
        assert secret not in recorded


async def test_a_bulk_request_starts_one_trace_per_document_linked_to_it(
    settings: RuntimeSettings, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    items = [{"title": TITLE, "acl": {"read": [PRINCIPAL]}} for _ in range(2)]
    files = [("file", (f"d{n}.txt", MARKER.encode(), "text/plain")) for n in range(2)]
    parts: list[tuple[str, Any]] = [("items", (None, json.dumps(items), "application/json"))]
    with traced() as exported:
        async with publisher_harness(settings) as api:
            answer = await api.client.post(
                acme.path("/documents/bulk"), files=parts + files, headers=acme.headers
            )
            assert answer.status_code == 200, answer.text
        spans = exported.get_finished_spans()

    request = one(spans, "kb.publish.bulk")
    documents = named(spans, "kb.publish")
    assert len(documents) == 2
    assert len({trace_id(d) for d in documents} | {trace_id(request)}) == 3
    for document in documents:
        assert document.parent is None
        assert linked_span_ids(document) == [span_id(request)]
        assert document.attributes is not None
        stored = await _stored(conn, str(document.attributes["kb.document_id"]))
        (traceparent,) = stored
        context = span_context_of(traceparent)
        assert context is not None
        assert context.span_id == span_id(document)
    recorded = every_recorded_text(spans)
    for secret in (MARKER, TITLE, PRINCIPAL, acme.key):
        assert secret not in recorded


async def test_without_tracing_nothing_is_stored(
    settings: RuntimeSettings, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    async with publisher_harness(settings) as api:
        created = await upload(api.client, acme)
        document_id = created.json()["documentId"]
        published = await publish(api.client, acme, document_id, 1, 1)
        assert published.status_code == 202, published.text
    assert await _stored(conn, document_id) == {None}
