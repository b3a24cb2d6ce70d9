"""One document's trace, as real processes export it: `kb serve`, `kb relay run` and
`kb indexer run` send OTLP/HTTP to a receiver in the test. One publish is one trace from
the request to the switch's event; a task taken over after its first worker was killed
shows both attempts in that trace; a task claimed by polling (no relay, so no Kafka
message) is still in it; and no exported span carries the document's text, its title,
its principal or the key."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.e2e.test_searchable import kb, started, stop, tail, wait_for_status, wait_ready
from tests.support.api import free_port
from tests.support.otlp import ReceivedSpan, Receiver, otlp_receiver
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

MARKER = "okapi-lantern-5521"
CONTENT = f"# Refund policy\n\nCustomers may return items within 30 days. {MARKER}\n".encode()
TITLE = "Quarterly secret refund memo"
PRINCIPAL = "group:refund-insiders"
PRODUCER = Span.SpanKind.SPAN_KIND_PRODUCER


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as started_receiver:
        yield started_receiver


@pytest.fixture
def traced_env(service_env: dict[str, str], receiver: Receiver) -> dict[str, str]:
    return {
        **service_env,
        "KB_EMBEDDING_PROVIDER": "hashing",
        "KB_INDEXER_POLL_SECONDS": "0.5",
        "KB_LOG_FORMAT": "json",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
        "OTEL_TRACES_SAMPLER": "always_on",
        # Export within a tenth of a second: a killed worker's claim is out before the kill.
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def _tenant(env: dict[str, str]) -> str:
    created = kb(env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    return created.stdout.strip().removeprefix("KB_API_KEY=")


async def _publish(client: httpx.AsyncClient) -> str:
    uploaded = await client.post(
        "/v1/tenants/acme/documents",
        files={"file": ("refunds.md", CONTENT, "text/markdown")},
        data={"title": TITLE},
    )
    assert uploaded.status_code == 201, uploaded.text
    document_id: str = uploaded.json()["documentId"]
    published = await client.post(
        f"/v1/tenants/acme/documents/{document_id}/versions/1/publish",
        json={"revision": uploaded.json()["revision"], "acl": {"read": [PRINCIPAL]}},
    )
    assert published.status_code == 202, published.text
    return document_id


def _publish_span(spans: list[ReceivedSpan], document_id: str) -> ReceivedSpan | None:
    found = [
        s
        for s in spans
        if s.name == "kb.publish" and s.attributes.get("kb.document_id") == document_id
    ]
    return found[0] if found else None


def _named(spans: list[ReceivedSpan], name: str, **attributes: object) -> list[ReceivedSpan]:
    return [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]


def _sent(spans: list[ReceivedSpan], topic: str, **attributes: object) -> list[ReceivedSpan]:
    """The relay's sends to ``topic`` (the test run's topic prefix before it)."""
    return [
        s
        for s in spans
        if s.name.startswith("send ")
        and str(s.attributes.get("messaging.destination.name", "")).endswith(topic)
        and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]


def _hanging_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`kb indexer run` whose first lease generation hangs (tests/support/hanging_worker.py)."""
    command = [sys.executable, "-m", "tests.support.hanging_worker", "--tier", "standard"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "--concurrency", "1"],
            env={**env, "KB_TEST_ONLY_HANG_GENERATIONS": "1"},
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _assert_no_content(spans: list[ReceivedSpan], key: str) -> None:
    recorded = "\n".join(text for span in spans for text in span.texts)
    for secret in (MARKER, "30 days", TITLE, PRINCIPAL, key, key.rsplit(".", 1)[-1]):
        assert secret not in recorded, secret


async def _searchable(
    env: dict[str, str], key: str, root: str, document_id: str, watched: list[Any]
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=root, headers=headers, timeout=10) as client:
        await wait_for_status(
            client, f"/v1/tenants/acme/documents/{document_id}", "SEARCHABLE", watched
        )


async def test_one_publish_is_one_trace_from_the_request_to_the_switch(
    traced_env: dict[str, str], receiver: Receiver, tmp_path: Path
) -> None:
    key = _tenant(traced_env)
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with ExitStack() as services:
        serve_log, relay_log, indexer_log = (
            tmp_path / f"{n}.log" for n in ("serve", "relay", "indexer")
        )
        server = services.enter_context(
            started(traced_env, serve_log, "serve", "--host", "127.0.0.1", "--port", str(port))
        )
        relay = services.enter_context(started(traced_env, relay_log, "relay", "run"))
        indexer = services.enter_context(
            started(traced_env, indexer_log, "indexer", "run", "--tier", "standard")
        )
        watched = [(server, serve_log), (relay, relay_log), (indexer, indexer_log)]
        await wait_ready(root, server, serve_log)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=root, headers=headers, timeout=10) as client:
            document_id = await _publish(client)
        await _searchable(traced_env, key, root, document_id, watched)

        def complete(spans: list[ReceivedSpan]) -> bool:
            publish = _publish_span(spans, document_id)
            if publish is None:
                return False
            mine = [s for s in spans if s.trace_id == publish.trace_id]
            return bool(
                _named(mine, "kb.index.attempt")
                and _sent(
                    mine,
                    "kb.document-events",
                    **{"kb.event_type": "DocumentSearchVersionSwitched"},
                )
            )

        spans = await receiver.wait_for(complete)
    publish = _publish_span(spans, document_id)
    assert publish is not None
    trace = receiver.in_trace(publish.trace_id)
    assert {s.service for s in trace} == {"kb-api", "kb-relay", "kb-indexer"}
    by_id = {s.span_id: s for s in trace}
    # The request's server span is the trace's root; the publish is under it.
    (root_span,) = [s for s in trace if not s.parent_span_id]
    assert root_span.service == "kb-api"
    assert root_span.attributes.get("http.request.method") == "POST"
    # The relay's send of the task's hint: a producer span, the publish's child.
    (hint,) = _sent(trace, "kb.index-hints.standard")
    assert hint.kind == PRODUCER
    assert hint.parent_span_id == publish.span_id
    assert hint.attributes["messaging.system"] == "kafka"
    # The attempt continues the publish (a hint's wake-up links to the message).
    (attempt,) = _named(trace, "kb.index.attempt")
    assert attempt.parent_span_id == publish.span_id
    assert attempt.attributes["kb.document_id"] == document_id
    assert attempt.attributes["kb.attempt.result"] == "SUCCEEDED"
    if attempt.attributes["kb.claim.woken_by"] == "hint":
        assert attempt.links == [hint.span_id]
    for step in (
        "kb.index.claim",
        "kb.index.parse_and_chunk",
        "kb.index.group_commit",
        "kb.index.switch",
    ):
        assert [s.parent_span_id for s in _named(trace, step)][:1] == [attempt.span_id], step
    # The version's read and the hand-over to the group commit: moments on the attempt.
    assert attempt.events == ("kb.index.loaded", "kb.index.commit_queued")
    # One span per embedding request, in the trace of its first document (this one, alone
    # in its request), under the parse it overlaps; the parse links to it, as every
    # document in the request does.
    (parse,) = _named(trace, "kb.index.parse_and_chunk")
    (embed,) = _named(trace, "kb.index.embed")
    assert embed.parent_span_id == parse.span_id
    assert parse.links == [embed.span_id]
    assert embed.attributes["gen_ai.provider.name"] == "HashingEmbedder"
    assert embed.attributes["kb.embedding.batch_size"] >= 1
    assert embed.attributes["kb.embedding.callers"] == 1
    # One span for the group's transaction (alone in its group, this task's trace holds
    # it); the switch links to it, as every switch of a group does.
    (group,) = _named(trace, "kb.index.group_commit")
    assert group.attributes["db.operation.batch.size"] >= 1
    # The switch's event goes on from the switch.
    (switch,) = _named(trace, "kb.index.switch")
    assert switch.links == [group.span_id]
    (switched,) = _sent(
        trace, "kb.document-events", **{"kb.event_type": "DocumentSearchVersionSwitched"}
    )
    assert switched.parent_span_id == switch.span_id
    assert all(s.parent_span_id in by_id for s in trace if s.parent_span_id)  # nothing lost
    _assert_no_content(receiver.spans, key)


async def test_a_task_taken_over_after_a_kill_shows_both_attempts_in_one_trace(
    traced_env: dict[str, str], receiver: Receiver, tmp_path: Path
) -> None:
    env = {**traced_env, "KB_INDEXER_LEASE_SECONDS": "2", "KB_INDEXER_POLL_SECONDS": "0.2"}
    key = _tenant(env)
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with ExitStack() as services:
        serve_log, relay_log = tmp_path / "serve.log", tmp_path / "relay.log"
        server = services.enter_context(
            started(env, serve_log, "serve", "--host", "127.0.0.1", "--port", str(port))
        )
        relay = services.enter_context(started(env, relay_log, "relay", "run"))
        await wait_ready(root, server, serve_log)
        doomed = _hanging_worker(env, tmp_path / "doomed.log")
        try:
            headers = {"Authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(base_url=root, headers=headers, timeout=10) as client:
                document_id = await _publish(client)
            await receiver.wait_for(
                lambda spans: bool(_named(spans, "kb.index.claim", **{"kb.lease_attempt": 1}))
            )
        finally:
            doomed.send_signal(signal.SIGKILL)
            doomed.wait()
        assert doomed.returncode == -signal.SIGKILL
        successor = _hanging_worker(env, tmp_path / "successor.log")
        try:
            watched = [
                (server, serve_log),
                (relay, relay_log),
                (successor, tmp_path / "successor.log"),
            ]
            await _searchable(env, key, root, document_id, watched)
            spans = await receiver.wait_for(
                lambda spans: bool(_named(spans, "kb.index.attempt", **{"kb.lease_attempt": 2}))
            )
        finally:
            assert stop(successor) == 0, tail(tmp_path / "successor.log")
    publish = _publish_span(spans, document_id)
    assert publish is not None
    trace = receiver.in_trace(publish.trace_id)
    # Generation 1 (killed) and 2 (the takeover) at least; on a slow machine the takeover
    # may itself lose its 2 s lease and a third generation finish the task: all in this trace.
    claims = sorted(s.attributes["kb.lease_attempt"] for s in _named(trace, "kb.index.claim"))
    assert claims == list(range(1, len(claims) + 1))
    assert len(claims) >= 2
    attempts = _named(trace, "kb.index.attempt")  # the killed one never ended: not there
    assert sorted(a.attributes["kb.lease_attempt"] for a in attempts) == claims[1:]
    assert all(a.parent_span_id == publish.span_id for a in attempts)
    assert "SUCCEEDED" in {a.attributes["kb.attempt.result"] for a in attempts}
    (first_claim,) = _named(trace, "kb.index.claim", **{"kb.lease_attempt": 1})
    # Under the killed attempt's span, which never reached the receiver.
    assert first_claim.parent_span_id not in {a.span_id for a in attempts}
    _assert_no_content(receiver.spans, key)


async def test_a_task_claimed_by_polling_is_still_in_the_publish_trace(
    traced_env: dict[str, str], receiver: Receiver, tmp_path: Path
) -> None:
    key = _tenant(traced_env)
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with ExitStack() as services:
        serve_log, indexer_log = tmp_path / "serve.log", tmp_path / "indexer.log"
        server = services.enter_context(
            started(traced_env, serve_log, "serve", "--host", "127.0.0.1", "--port", str(port))
        )
        # No relay: no Kafka message will ever name the task; the poll finds it.
        indexer = services.enter_context(
            started(traced_env, indexer_log, "indexer", "run", "--tier", "standard")
        )
        await wait_ready(root, server, serve_log)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=root, headers=headers, timeout=10) as client:
            document_id = await _publish(client)
        await _searchable(
            traced_env, key, root, document_id, [(server, serve_log), (indexer, indexer_log)]
        )
        spans = await receiver.wait_for(lambda spans: bool(_named(spans, "kb.index.switch")))
    publish = _publish_span(spans, document_id)
    assert publish is not None
    trace = receiver.in_trace(publish.trace_id)
    (attempt,) = _named(trace, "kb.index.attempt")
    assert attempt.parent_span_id == publish.span_id
    assert attempt.attributes["kb.claim.woken_by"] == "poll"
    assert attempt.links == []
    assert not [s for s in trace if s.kind == PRODUCER]
    _assert_no_content(receiver.spans, key)
