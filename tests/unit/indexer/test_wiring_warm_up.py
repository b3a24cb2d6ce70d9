"""`kb indexer run` claims while its model warms up, and stops if the warm-up fails."""

from __future__ import annotations

import asyncio

import pytest

from services.indexer.wiring import _unless_warm_up_fails
from services.runtime.errors import ConfigError


async def test_work_goes_on_once_the_warm_up_succeeded() -> None:
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    finish = asyncio.Event()

    async def work() -> str:
        await finish.wait()
        return "done"

    running = asyncio.create_task(_unless_warm_up_fails(work(), ready))
    ready.set_result(None)
    await asyncio.sleep(0)
    assert not running.done()  # the warm-up ending does not end the work
    finish.set()
    assert await running == "done"


async def test_a_failed_warm_up_cancels_the_work_and_raises() -> None:
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    running = asyncio.create_task(_unless_warm_up_fails(work(), ready))
    await asyncio.sleep(0)
    ready.set_exception(ConfigError("the model file does not match its pinned digest"))
    with pytest.raises(ConfigError, match="pinned digest"):
        await running
    assert cancelled.is_set()
