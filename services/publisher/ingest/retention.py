"""The retention of refused commands' records (``ingest_refusal``, migration 0036): every
`kb ingest run` deletes those older than ``KB_INGEST_REFUSAL_RETENTION_DAYS`` by the
database's clock, a batch (one statement) at a time, once an hour.

Why the horizon is safe: a refusal record only matters while its command may be read again,
and Kafka gives a record again only while its topic holds it (a redelivery from the last
committed offset, or a group whose offsets expired starting over from the earliest record).
A record still held is younger than the topic's ``retention.ms`` plus its ``segment.ms``
(Kafka deletes whole segments), and its refusal younger still, so with both inside the
horizon no command is dead-lettered twice (docs/configuration.md; a topic kept forever
needs the horizon 0, records kept forever too).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import datetime

from services.publisher.ingest.ports import Refusals
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)


@dataclass
class RefusalRetention:
    store: Refusals
    days: int  # KB_INGEST_REFUSAL_RETENTION_DAYS; 0 keeps every record
    batch: int = 10_000
    # Nothing here is urgent: an hour's records more are a few rows.
    interval_seconds: float = 3600.0

    async def collect(self, now: datetime | None = None, *, max_batches: int = 1000) -> int:
        """Batches until none is full (or ``max_batches``); how many records went."""
        if self.days == 0:
            return 0
        removed = 0
        for _ in range(max_batches):
            done = await self.store.remove_refusals(self.days, self.batch, now)
            removed += done
            if done < self.batch:
                break
        if removed:
            log.info("ingest.refusals_removed", rows=removed, days=self.days)
        return removed

    async def run(self, stop: asyncio.Event) -> None:
        """A pass now and every ``interval_seconds`` until ``stop``; a failed pass is logged
        and tried again at the next one (it never holds the commands up)."""
        while not stop.is_set():
            try:
                await self.collect()
            except KbError as error:
                log.warning("ingest.refusal_retention_failed", code=error.code, error=str(error))
            except Exception:
                # Not one of ours (a bug): said, and tried again, rather than ending the
                # retention for the process's life without a word.
                log.exception("ingest.refusal_retention_failed", code="INTERNAL_ERROR")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_seconds)
