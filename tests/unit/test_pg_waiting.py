"""A start-up step waits through a database that is away (services/runtime/pg/waiting.py):
run again while it fails with a retriable error, the driver's errors translated first; any
other error ends it at once; ``stop`` ends the wait."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

from services.runtime.backoff import Backoff
from services.runtime.errors import ConfigError, DatabaseBusy, DatabaseUnavailable
from services.runtime.pg.waiting import StoppedWaiting, once, retrying, when_available

QUICK = Backoff(0.001, 0.002, 0.0)


def failing(*errors: BaseException) -> tuple[Callable[[], Coroutine[Any, Any, str]], list[int]]:
    """An attempt that raises ``errors`` in turn, then answers "up"; and its call count."""
    calls = [0]

    async def attempt() -> str:
        calls[0] += 1
        if calls[0] <= len(errors):
            raise errors[calls[0] - 1]
        return "up"

    return attempt, calls


async def test_retriable_errors_and_raw_driver_errors_are_waited_through() -> None:
    attempt, calls = failing(
        ConnectionRefusedError(111, "Connect call failed"),  # the server down
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        DatabaseBusy("statement timeout"),
    )
    with capture_logs() as logs:
        answer = await when_available("open_pool", attempt, stop=asyncio.Event(), backoff=QUICK)
    assert (answer, calls[0]) == ("up", 6)
    waits = [entry for entry in logs if entry["event"] == "database.unavailable"]
    assert [entry["failures"] for entry in waits] == [1, 2, 3, 4, 5]
    assert {entry["step"] for entry in waits} == {"open_pool"}
    assert [entry["error_code"] for entry in waits] == ["DATABASE_UNAVAILABLE"] * 4 + [
        "DATABASE_BUSY"
    ]


async def test_an_error_no_retry_fixes_ends_the_start_at_once() -> None:
    attempt, calls = failing(DatabaseUnavailable("away"), ConfigError("dimension differs"))
    with pytest.raises(ConfigError):
        await when_available("register_default", attempt, stop=asyncio.Event(), backoff=QUICK)
    assert calls[0] == 2


async def test_a_bug_is_not_retried() -> None:
    attempt, calls = failing(ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        await when_available("open_pool", attempt, stop=asyncio.Event(), backoff=QUICK)
    assert calls[0] == 1


async def test_stop_ends_the_wait() -> None:
    stop = asyncio.Event()
    calls = [0]

    async def away() -> str:
        calls[0] += 1
        stop.set()  # SIGTERM while the database is away
        raise DatabaseUnavailable("away")

    step = retrying(stop, Backoff(30.0, 60.0, 0.0), random.Random(1))
    with pytest.raises(StoppedWaiting):
        await step("open_pool", away)
    assert calls[0] == 1


async def test_once_reports_the_first_failure() -> None:
    attempt, calls = failing(DatabaseUnavailable("away"))
    with pytest.raises(DatabaseUnavailable):
        await once("open_pool", attempt)
    assert calls[0] == 1
