"""The ingest retention's loop outlives a failed pass, whatever failed, and one kind's
failure does not keep the other's records from going."""

from __future__ import annotations

import asyncio
from datetime import datetime

from services.publisher.ingest.retention import IngestRetention
from services.runtime.errors import DatabaseUnavailable


class FailingThenCounting:
    """Its refusal passes fail twice (one of ours, then a bug's), then the loop stops at the
    third; its command passes count their calls."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.calls = 0
        self.command_calls = 0

    async def remove_refusals(self, days: int, most: int, now: datetime | None = None) -> int:
        self.calls += 1
        if self.calls == 1:
            raise DatabaseUnavailable("database unreachable")
        if self.calls == 2:
            raise RuntimeError("a bug")
        self.stop.set()
        return 0

    async def remove_commands(self, days: int, most: int, now: datetime | None = None) -> int:
        self.command_calls += 1
        return 0


async def test_a_failed_pass_is_tried_again_at_the_next_one() -> None:
    stop = asyncio.Event()
    store = FailingThenCounting(stop)
    retention = IngestRetention(store, refusal_days=30, command_days=30, interval_seconds=0.0)
    await asyncio.wait_for(retention.run(stop), timeout=30)
    assert store.calls == 3
    # Every pass removed the commands' records, the failed refusal passes too.
    assert store.command_calls == 3
