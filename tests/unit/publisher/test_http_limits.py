"""The publisher's request limits, on the app's middlewares without a database."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from services.publisher.web.body_limit import BodyLimitMiddleware
from services.publisher.web.readiness import ReadinessProbe
from services.publisher.web.upload_budget import UploadBudget, UploadBudgetMiddleware
from services.runtime.errors import DatabaseUnavailable


def _scope(content_type: bytes, length: int | None) -> Scope:
    headers = [(b"content-type", content_type)]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/tenants/acme/documents",
        "headers": headers,
    }


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}

    def json(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.messages[1]["body"])
        return body


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_uploads_beyond_the_budget_get_503_with_retry_after_before_their_body_is_read() -> (
    None
):
    budget = UploadBudget(capacity_bytes=100)
    inside = asyncio.Event()
    leave = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        inside.set()
        await leave.wait()

    middleware = UploadBudgetMiddleware(
        app, budget=budget, max_request_bytes=80, retry_after_seconds=3
    )
    first = asyncio.create_task(
        middleware(_scope(b"multipart/form-data; b=x", 60), _never, Recorder())
    )
    await inside.wait()
    assert budget.in_use_bytes == 60

    received: list[Message] = []

    async def receive() -> Message:
        # The body of a refused upload streams in three chunks and is dropped.
        received.append({"type": "http.request", "body": b"x" * 20, "more_body": len(received) < 2})
        return received[-1]

    refused = Recorder()
    await middleware(_scope(b"multipart/form-data; b=x", 50), receive, refused)
    assert refused.status == 503
    assert refused.headers["retry-after"] == "3"
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["errorCode"] == "UPLOADS_BUSY"
    assert len(received) == 3  # read to its end before the answer, so the answer arrives
    # A client that waits for "100 Continue" is answered without being asked for its body.
    received.clear()
    expecting = _scope(b"multipart/form-data; b=x", 50)
    expecting["headers"].append((b"expect", b"100-continue"))
    refused_early = Recorder()
    await middleware(expecting, receive, refused_early)
    assert refused_early.status == 503
    assert received == []
    # Undeclared sizes reserve the whole request limit.
    received.clear()
    undeclared = Recorder()
    await middleware(_scope(b"multipart/form-data; b=x", None), receive, undeclared)
    assert undeclared.status == 503
    # A JSON body is not an upload: never refused by the budget.
    passed = asyncio.create_task(middleware(_scope(b"application/json", 10), receive, Recorder()))
    leave.set()
    await asyncio.gather(first, passed)
    assert budget.in_use_bytes == 0
    # With the budget free again the same upload goes through.
    received.clear()
    ok = Recorder()
    await middleware(_scope(b"multipart/form-data; b=x", 50), receive, ok)
    assert ok.messages == []  # the (silent) app ran
    assert budget.in_use_bytes == 0


def test_one_upload_is_admitted_even_above_a_small_budget() -> None:
    budget = UploadBudget(capacity_bytes=10)
    assert budget.try_reserve(50)
    assert not budget.try_reserve(1)
    budget.release(50)
    assert budget.try_reserve(10)


async def test_a_stalled_body_gets_408() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()

    middleware = BodyLimitMiddleware(
        app, max_upload_bytes=1000, max_other_bytes=100, read_timeout_seconds=0.01
    )
    with pytest.raises(StarletteHTTPException) as caught:
        # The outer bound only turns "waits forever" into a failure of this test.
        async with asyncio.timeout(10):
            await middleware(_scope(b"multipart/form-data; b=x", 10), _never, Recorder())
    # FastAPI turns this exception, met while reading the body, into the 408 answer.
    assert caught.value.status_code == 408


async def test_json_bodies_have_their_own_small_limit() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("must not run")

    middleware = BodyLimitMiddleware(
        app, max_upload_bytes=10_000, max_other_bytes=100, read_timeout_seconds=1
    )
    refused = Recorder()
    await middleware(_scope(b"application/json", 101), _never, refused)
    assert refused.status == 413
    assert refused.json()["errorCode"] == "PAYLOAD_TOO_LARGE"


async def test_readiness_is_checked_at_most_once_per_interval_and_shared() -> None:
    calls = 0
    release = asyncio.Event()
    problems: list[str] = []

    async def check() -> list[str]:
        nonlocal calls
        calls += 1
        await release.wait()
        return list(problems)

    now = 100.0
    probe = ReadinessProbe(check, cache_seconds=1.0, monotonic=lambda: now)
    waiting = [asyncio.create_task(probe.is_ready()) for _ in range(20)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiting) == [True] * 20
    assert calls == 1
    problems.append("migration 0007_x is not applied")
    now += 0.5
    assert await probe.is_ready()
    assert calls == 1
    now += 0.6
    assert not await probe.is_ready()
    assert calls == 2


async def test_a_failing_readiness_check_is_not_ready() -> None:
    async def check() -> list[str]:
        raise DatabaseUnavailable("database unreachable: secret-host:5432")

    assert not await ReadinessProbe(check, cache_seconds=0).is_ready()
