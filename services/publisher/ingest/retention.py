"""The retention of the ingest consumer's own records: refused commands' (``ingest_refusal``,
migration 0036; ``KB_INGEST_REFUSAL_RETENTION_DAYS``) and applied commands'
(``ingest_command``, migration 0033; ``KB_INGEST_COMMAND_RETENTION_DAYS``). Every
`kb ingest run` deletes those older than their horizon by the database's clock, a batch
(one statement) at a time, once an hour.

Why the horizons are safe: either record only matters while its command may be read again
-- a refusal keeps a redelivered command from being dead-lettered twice, a command record
keeps it from being applied twice -- and Kafka gives a record again only while its topic
holds it (a redelivery from the last committed offset, or a group whose offsets expired
starting over from the earliest record; `kb ingest replay-dead` reads the dead-letter
topic the same way). A record still held is younger than the topic's ``retention.ms`` plus
its ``segment.ms`` (Kafka deletes whole segments), and its refusal or command record
younger still, so with both inside the horizon no command is handled twice
(docs/configuration.md; a topic kept forever needs the horizon 0, records kept forever too).

A command record whose index task is still to run is kept past its horizon: the indexer's
switch and dead events name the command from it. A task requeued by an operator after the
record went reports no command, as a publish over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from services.publisher.ingest.ports import Retained
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)

Kind = Literal["refusals", "commands"]
# Each kind's log events: its records removed, its pass failed (each kind's pass runs even
# when the other's failed).
EVENTS: dict[Kind, tuple[str, str]] = {
    "refusals": ("ingest.refusals_removed", "ingest.refusal_retention_failed"),
    "commands": ("ingest.commands_removed", "ingest.command_retention_failed"),
}


@dataclass
class IngestRetention:
    store: Retained
    refusal_days: int  # KB_INGEST_REFUSAL_RETENTION_DAYS; 0 keeps every record
    command_days: int = 0  # KB_INGEST_COMMAND_RETENTION_DAYS; 0 keeps every record
    batch: int = 10_000
    # Nothing here is urgent: an hour's records more are a few rows.
    interval_seconds: float = 3600.0

    async def collect(self, now: datetime | None = None, *, max_batches: int = 1000) -> int:
        """Both kinds, each in batches until none is full (or ``max_batches``); how many
        records went."""
        removed = 0
        for kind in EVENTS:
            removed += await self.collect_kind(kind, now, max_batches=max_batches)
        return removed

    async def collect_kind(
        self, kind: Kind, now: datetime | None = None, *, max_batches: int = 1000
    ) -> int:
        """One kind's records past its horizon, in batches; how many went."""
        remove, days = (
            (self.store.remove_refusals, self.refusal_days)
            if kind == "refusals"
            else (self.store.remove_commands, self.command_days)
        )
        if days == 0:
            return 0
        removed = 0
        for _ in range(max_batches):
            done = await remove(days, self.batch, now)
            removed += done
            if done < self.batch:
                break
        if removed:
            log.info(EVENTS[kind][0], rows=removed, days=days)
        return removed

    async def run(self, stop: asyncio.Event) -> None:
        """A pass now and every ``interval_seconds`` until ``stop``; a failed pass is logged
        and tried again at the next one (it never holds the commands up), and one kind's
        failure does not keep the other's pass from running."""
        while not stop.is_set():
            for kind, (_, failed) in EVENTS.items():
                await _logged(self.collect_kind(kind), failed)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_seconds)


async def _logged(step: Awaitable[int], event: str) -> None:
    try:
        await step
    except KbError as error:
        log.warning(event, code=error.code, error=str(error))
    except Exception:
        # Not one of ours (a bug): said, and tried again, rather than ending the retention
        # for the process's life without a word.
        log.exception(event, code="INTERNAL_ERROR")
