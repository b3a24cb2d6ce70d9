"""A long-running process's start-up steps, waited through a database that is away.

A process that opens its pool and registers what it needs at start would otherwise exit when
PostgreSQL restarts in the middle of that (RELIABILITY.md, "exited on PostgreSQL's restart"):
its supervisor may not restart a process that had already started. Each step here is run
again after a capped, jittered backoff for as long as it fails with a retriable error (the
server refusing connections, a session ended by an administrator, a pool error), the
driver's errors translated first. A step that fails otherwise ends the start as before, and
``stop`` (SIGTERM) ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from services.runtime.backoff import Backoff
from services.runtime.errors import KbError
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors

log = get_logger(__name__)
T = TypeVar("T")


class Step(Protocol):
    """How a start-up step is run: its name (logged) and its work, which must be safe to
    run again from its beginning."""

    async def __call__(self, name: str, attempt: Callable[[], Awaitable[T]], /) -> T: ...


class StoppedWaiting(Exception):
    """``stop`` was set while a start-up step waited for the database: nothing started,
    nothing to finish."""


async def once(step: str, attempt: Callable[[], Awaitable[T]], /) -> T:
    """A step run once: for short commands, which report an unreachable database at once."""
    return await attempt()


def retrying(stop: asyncio.Event, backoff: Backoff, rng: random.Random | None = None) -> Step:
    """Steps run by ``when_available`` with ``stop`` and ``backoff``."""

    async def step(name: str, attempt: Callable[[], Awaitable[T]], /) -> T:
        return await when_available(name, attempt, stop=stop, backoff=backoff, rng=rng)

    return step


async def when_available(
    step: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    stop: asyncio.Event,
    backoff: Backoff,
    rng: random.Random | None = None,
) -> T:
    """``attempt()``'s result, tried again while it fails with a retriable error; raises
    ``StoppedWaiting`` once ``stop`` is set during a wait, and any other error at once."""
    failures = 0
    while True:
        try:
            with translate_db_errors():
                return await attempt()
        except KbError as error:
            if not error.retriable:
                raise
            failures += 1
            delay = backoff.delay(failures, rng)
            log.warning(
                "database.unavailable",
                step=step,
                error_code=error.code,
                error=str(error),
                failures=failures,
                retry_in_seconds=round(delay, 3),
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()
        if stop.is_set():
            raise StoppedWaiting(step)
