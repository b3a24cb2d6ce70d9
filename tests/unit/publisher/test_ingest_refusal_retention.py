"""The refusal retention's loop outlives a failed pass, whatever failed."""

from __future__ import annotations

import asyncio
from datetime import datetime

from services.publisher.ingest.retention import RefusalRetention
from services.runtime.errors import DatabaseUnavailable


class FailingThenCounting:
    """Fails its first two passes (one of ours, then a bug's), then counts the calls and
    stops the loop at the third."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.calls = 0

    async def remove_refusals(self, days: int, most: int, now: datetime | None = None) -> int:
        self.calls += 1
        if self.calls == 1:
            raise DatabaseUnavailable("database unreachable")
        if self.calls == 2:
            raise RuntimeError("a bug")
        self.stop.set()
        return 0


async def test_a_failed_pass_is_tried_again_at_the_next_one() -> None:
    stop = asyncio.Event()
    store = FailingThenCounting(stop)
    retention = RefusalRetention(store, days=30, interval_seconds=0.0)
    await asyncio.wait_for(retention.run(stop), timeout=30)
    assert store.calls == 3
