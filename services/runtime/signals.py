"""Graceful shutdown: SIGTERM and SIGINT set a stop event instead of killing the process.

A long-running command (``kb indexer run``, ``kb relay run``, ``kb serve``) runs its main
coroutine with the event; the coroutine stops taking new work when it is set and finishes
what it holds. A second signal changes nothing: the grace period is the command's to keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Final, TypeVar

T = TypeVar("T")

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(
    stop: asyncio.Event | None = None, *, on_signal: Callable[[], None] | None = None
) -> Iterator[asyncio.Event]:
    """Within the block (on the running loop), SIGTERM/SIGINT set the returned event and
    call ``on_signal`` (e.g. to tell a server to exit); the previous handling comes back
    after it."""
    event = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()

    def _stop() -> None:
        event.set()
        if on_signal is not None:
            on_signal()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, _stop)
    try:
        yield event
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


async def run_until_signalled(
    main: Callable[[asyncio.Event], Awaitable[T]], stop: asyncio.Event | None = None
) -> T:
    """``await main(stop)`` with SIGTERM/SIGINT setting ``stop``."""
    with stop_on_signals(stop) as event:
        return await main(event)


async def unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> asyncio.Task[T]:
    """Run ``work`` until it ends or ``stop`` is set, whichever comes first: then it is
    cancelled and waited for (what it raises while it goes is not this caller's). Its task:
    done, or cancelled."""
    running = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await running
    return running


async def ignoring_foreign_cancellation(done: Awaitable[None]) -> None:
    """Await ``done`` (a client's close or stop), letting a cancellation through only when
    it is this task's: a client library can re-raise the cancellation of its own internal
    tasks, and that must not end the caller."""
    try:
        await done
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
