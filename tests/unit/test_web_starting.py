"""An app whose start waits for its database in the background
(services/runtime/web/starting.py): a failed attempt is undone and tried again, an error no
retry fixes stops the server, the stop ends the wait; until started, the probes and a
refusal answer instead of the app. (A real `kb serve` over a stopped server:
tests/e2e/test_pg_restart.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from structlog.testing import capture_logs

from services.runtime.backoff import Backoff
from services.runtime.errors import ConfigError, DatabaseUnavailable
from services.runtime.web.starting import BackgroundStart, start_in_background

QUICK = Backoff(0.001, 0.002, 0.0)


class Resources:
    """A lifespan that fails with ``errors`` in turn before it opens; what it opened and
    closed."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.opened = 0
        self.closed = 0
        self.attempts = 0
        self.attempted = asyncio.Event()
        self.entered = asyncio.Event()

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        self.attempts += 1
        self.attempted.set()
        self.opened += 1
        try:
            if self.errors:
                raise self.errors.pop(0)
            self.entered.set()
            yield
        finally:
            self.closed += 1


async def test_a_retriable_failure_is_undone_and_tried_again_until_the_start_holds() -> None:
    resources = Resources(DatabaseUnavailable("away"), DatabaseUnavailable("still away"))
    failures: list[BaseException] = []
    start = BackgroundStart(failures.append)
    stop = asyncio.Event()
    with capture_logs() as logs:
        running = asyncio.create_task(start.run(resources.lifespan, None, stop, QUICK))
        await resources.entered.wait()
        assert start.started
        assert (resources.attempts, resources.opened - resources.closed) == (3, 1)
        stop.set()
        await running
    assert (start.started, start.failure, failures) == (False, None, [])
    assert resources.opened == resources.closed == 3
    events = [entry["event"] for entry in logs]
    assert events.count("database.unavailable") == 2
    assert "serve.ready" in events


async def test_an_error_no_retry_fixes_is_handed_over_to_stop_the_server() -> None:
    resources = Resources(DatabaseUnavailable("away"), ConfigError("bad setting"))
    failures: list[BaseException] = []
    start = BackgroundStart(failures.append)
    await start.run(resources.lifespan, None, asyncio.Event(), QUICK)
    assert isinstance(start.failure, ConfigError)
    assert failures == [start.failure]
    assert (start.started, resources.attempts, resources.closed) == (False, 2, 2)


async def test_the_stop_ends_the_wait_with_nothing_started() -> None:
    resources = Resources(*[DatabaseUnavailable("away")] * 1000)
    failures: list[BaseException] = []
    start = BackgroundStart(failures.append)
    stop = asyncio.Event()
    with capture_logs() as logs:
        running = asyncio.create_task(
            start.run(resources.lifespan, None, stop, Backoff(60.0, 60.0, 0.0))
        )
        await resources.attempted.wait()
        stop.set()
        await running
    assert (start.started, start.failure, failures) == (False, None, [])
    assert resources.opened == resources.closed == 1
    assert "serve.stopped_at_start" in [entry["event"] for entry in logs]


async def test_the_servers_stop_cancels_an_attempt_under_way() -> None:
    """A connection to a host that does not answer: the stop does not wait for it."""
    attempted = asyncio.Event()
    closed: list[bool] = []

    @asynccontextmanager
    async def hanging(app: Any) -> AsyncIterator[None]:
        attempted.set()
        try:
            await asyncio.Event().wait()  # never answers
            yield
        finally:
            closed.append(True)

    app = FastAPI(lifespan=hanging)
    start = start_in_background(app, QUICK, on_failure=lambda _: None)
    with capture_logs() as logs:
        async with app.router.lifespan_context(app):
            await attempted.wait()
    assert (start.started, start.failure, closed) == (False, None, [True])
    assert "serve.stopped_at_start" in [entry["event"] for entry in logs]


def _app() -> tuple[FastAPI, BackgroundStart]:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.get("/v1/things")
    async def things() -> dict[str, str]:
        return {"things": "here"}

    return app, start_in_background(app, QUICK, on_failure=lambda _: None)


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/healthz", 200, None),
        ("/readyz", 503, "NOT_READY"),
        ("/v1/things", 503, "DATABASE_UNAVAILABLE"),
    ],
)
async def test_until_started_the_probes_and_a_refusal_answer(
    path: str, status: int, code: str | None
) -> None:
    app, _ = _app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        answer = await c.get(path)
    assert answer.status_code == status
    if code is not None:
        assert answer.json()["errorCode"] == code
        assert answer.headers["content-type"] == "application/problem+json"
    if code == "DATABASE_UNAVAILABLE":
        assert int(answer.headers["Retry-After"]) > 0


async def test_once_started_the_app_answers() -> None:
    app, start = _app()
    start.started = True
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/v1/things")).json() == {"things": "here"}
        assert (await c.get("/readyz")).json() == {"status": "ready"}
