"""The sink's write with its time observed (the ``sink`` stage of
``kb_indexer_stage_seconds``): the fenced write, and the slices staged before it.

A write the queue can put in a group written together (``WritableTogether``) stays one: the
wrapper passes ``together`` on, and each task of such a group is observed with the
group's time, which it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.indexer import metrics
from services.indexer.ports import InTransaction, WritableTogether, writable_together
from services.indexer.task import Lease
from services.runtime.pg.transaction import Transaction


def timed(write: InTransaction, lease: Lease, staging_seconds: float) -> InTransaction:
    together = writable_together(write)
    if together is not None:
        return TimedTogetherWrite(together, lease.tier, staging_seconds)

    async def timed_write(transaction: Transaction) -> None:
        began = time.perf_counter()
        await write(transaction)
        _observe(lease.tier, staging_seconds + time.perf_counter() - began)

    return timed_write


def _observe(tier: str, seconds: float) -> None:
    metrics.STAGE_SECONDS.labels(tier, "sink").observe(seconds)


# Compared by identity, as the write it wraps: only ``together`` says which writes group.
@dataclass(frozen=True, eq=False)
class TimedTogetherWrite:
    """A ``WritableTogether`` write, timed alone or in its group."""

    inner: WritableTogether
    tier: str
    staging_seconds: float

    @property
    def lease(self) -> Lease:
        return self.inner.lease

    @property
    def together(self) -> Callable[[Transaction, Sequence[Any]], Awaitable[None]]:
        # Equal for every write of one sink: the queue groups writes by it.
        return _TimedTogether(self.inner.together)

    async def __call__(self, conn: Transaction) -> None:
        began = time.perf_counter()
        await self.inner(conn)
        self.observe(time.perf_counter() - began)

    def observe(self, write_seconds: float) -> None:
        _observe(self.tier, self.staging_seconds + write_seconds)


@dataclass(frozen=True)
class _TimedTogether:
    inner: Callable[[Transaction, Sequence[Any]], Awaitable[None]]

    async def __call__(self, conn: Transaction, writes: Sequence[Any]) -> None:
        began = time.perf_counter()
        await self.inner(conn, [write.inner for write in writes])
        seconds = time.perf_counter() - began
        for write in writes:
            write.observe(seconds)
