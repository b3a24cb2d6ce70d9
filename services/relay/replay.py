"""Replay: re-send a range of the outbox marked ``replay=true``, rate-limited.

It only reads the outbox (keyset pages in position order) and sends with a producer of
its own, so live delivery, its leases and its progress are untouched. The range is fixed
when the replay starts (``up_to_position`` defaults to the last position then), so a
replay always ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from services.relay import metrics
from services.relay.ports import EventSink, OutboxSource, ReplayFilter
from services.runtime.backoff import Backoff
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)

DEFAULT_BACKOFF = Backoff(base_seconds=0.2, cap_seconds=10.0)


class ReplayInterrupted(KbError):
    """Kafka stayed unavailable; the message says where to resume."""

    code = "REPLAY_INTERRUPTED"
    retriable = True


@dataclass(frozen=True)
class ReplayResult:
    sent: int
    total: int
    last_position: int | None


async def replay(
    source: OutboxSource,
    sink: EventSink,
    where: ReplayFilter,
    *,
    rate: float | None = None,
    batch_size: int = 500,
    max_attempts: int = 8,
    backoff: Backoff = DEFAULT_BACKOFF,
) -> ReplayResult:
    if where.up_to_position is None:
        where = dataclasses.replace(where, up_to_position=await source.replay_last_position())
    total = await source.replay_count(where)
    metrics.REPLAY_TOTAL.set(total)
    metrics.REPLAY_SENT.set(0)
    log.info("replay.started", total=total, after_position=where.after_position)
    limit = batch_size if rate is None else max(1, min(batch_size, int(rate // 10) or 1))
    sent = 0
    last_position: int | None = None
    started = time.monotonic()
    while True:
        batch = await source.replay_batch(where, limit)
        if not batch:
            break
        for attempt in range(1, max_attempts + 1):
            try:
                await sink.send(batch, replay=True)
                break
            except KbError as error:
                if not error.retriable or attempt == max_attempts:
                    raise ReplayInterrupted(
                        f"stopped after {sent} of {total} events: {error.message}; resume "
                        f"with --from {batch[0].position}"
                    ) from error
                log.warning("replay.retry", error=str(error), attempt=attempt)
                await asyncio.sleep(backoff.delay(attempt))
        sent += len(batch)
        last_position = batch[-1].position
        metrics.REPLAY_SENT.set(sent)
        where = dataclasses.replace(where, after_position=last_position)
        if rate is not None:
            # Pace to `rate` events/s on average since the start.
            ahead = started + sent / rate - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
    log.info("replay.finished", sent=sent, last_position=last_position)
    return ReplayResult(sent=sent, total=total, last_position=last_position)
