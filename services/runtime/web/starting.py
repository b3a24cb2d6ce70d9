"""An HTTP app that listens while its start waits for a database that is away (`kb serve`).

uvicorn binds its port only once the app's lifespan has started, so a lifespan that waited
for PostgreSQL in place would leave the port closed: an orchestrator's liveness probe would
fail and restart a process that only waits (RELIABILITY.md, "a service started before its
database"). Here the lifespan's start runs in the background instead, each failed attempt
undone and tried again from its beginning while the error is retriable
(``services.runtime.pg.waiting``, ``database.unavailable``). Meanwhile the server answers:
``/healthz`` and ``/metrics`` as usual, ``/readyz`` 503 ``NOT_READY``, every other request
503 ``DATABASE_UNAVAILABLE`` with a ``Retry-After``. The server's own stop (SIGTERM) ends
the wait, an attempt under way cancelled; an error that is not retriable is handed to
``on_failure`` to stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from services.runtime.backoff import Backoff
from services.runtime.logging import get_logger
from services.runtime.pg.waiting import StoppedWaiting, when_available
from services.runtime.web.http_problem import problem_response

log = get_logger(__name__)

# Answered as usual while the start waits: the process is alive and its counters are read.
PASSING = frozenset({"/healthz", "/metrics"})
READINESS = "/readyz"
RETRY_AFTER_SECONDS = 5

Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


class BackgroundStart:
    """Where the app's start stands: ``started`` once its lifespan has entered (until it
    is left), ``failure`` when it ended on an error that waiting would not cure."""

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self.started = False
        self.failure: BaseException | None = None
        self._on_failure = on_failure

    async def run(
        self, lifespan: Lifespan, app: Any, stop: asyncio.Event, backoff: Backoff
    ) -> None:
        """Enters ``lifespan(app)`` (again from its beginning after each retriable failure),
        holds it until ``stop``, then leaves it."""

        async def enter() -> AbstractAsyncContextManager[None]:
            entered = lifespan(app)
            await entered.__aenter__()
            return entered

        try:
            entered = await when_available("start", enter, stop=stop, backoff=backoff)
        except StoppedWaiting:
            log.info("serve.stopped_at_start")
            return
        except asyncio.CancelledError:
            log.info("serve.stopped_at_start")
            raise
        except Exception as error:
            self.failure = error
            log.error("serve.start_failed", error=str(error), error_type=type(error).__name__)
            self._on_failure(error)
            return
        self.started = True
        log.info("serve.ready")
        try:
            await stop.wait()
        finally:
            self.started = False
            await entered.__aexit__(None, None, None)


def start_in_background(
    app: Any, backoff: Backoff, *, on_failure: Callable[[BaseException], None]
) -> BackgroundStart:
    """Makes ``app`` (a Starlette/FastAPI app not yet serving) start in the background as
    the module says, and answer for itself until it has started."""
    start = BackgroundStart(on_failure)
    lifespan: Lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def background(app: Any) -> AsyncIterator[None]:
        stop = asyncio.Event()
        running = asyncio.create_task(start.run(lifespan, app, stop, backoff))
        try:
            yield
        finally:
            stop.set()
            if not start.started:
                # An attempt under way is not waited for: a connection to a host that does
                # not answer would hold the stop for the driver's whole connect timeout.
                running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running

    app.router.lifespan_context = background
    app.add_middleware(StartingMiddleware, start=start)  # outermost: before anything else
    return start


class StartingMiddleware:
    """Until the start has finished: the answers the module names, without the app."""

    def __init__(self, app: ASGIApp, *, start: BackgroundStart) -> None:
        self.app = app
        self.start = start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.start.started or scope["type"] != "http" or scope["path"] in PASSING:
            await self.app(scope, receive, send)
            return
        if scope["path"] == READINESS:
            answer = problem_response(
                503, "NOT_READY", "the service is not ready", instance=READINESS
            )
        else:
            answer = problem_response(
                503,
                "DATABASE_UNAVAILABLE",
                "the service is starting: its database is not reached yet",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        await answer(scope, receive, send)
