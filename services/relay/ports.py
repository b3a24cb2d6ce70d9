"""What the relay loop needs from the outside world, as protocols.

The loop (``relay.py``) and the replay (``replay.py``) only see these; the adapters are
``outbox_pg.py`` (PostgreSQL) and ``sink_kafka.py`` (aiokafka).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from services.runtime.errors import KbError


@dataclass(frozen=True)
class OutboxRecord:
    position: int
    event_id: uuid.UUID
    event_type: str
    tenant_id: str
    tier: str
    aggregate_key: str
    payload: bytes
    created_at: datetime
    # A WAL position read after the row's transaction committed (relay queries.sql): sent as
    # the search_token header of DocumentSearchVersionSwitched. None: not read (fakes).
    search_token: str | None = None
    # The writer's W3C trace context (migration 0034): the send continues its trace.
    traceparent: str | None = None


@dataclass(frozen=True)
class Progress:
    """Where a partition stands (see migrations/0004_relay.sql): everything visible in
    ``delivered`` is acknowledged; ``window`` (positions up to ``window_end``) is being
    drained and is acknowledged up to ``window_position``; below ``window_start`` it holds
    only rows of transactions still open at ``delivered`` (migrations/0008)."""

    delivered: str
    window: str | None = None
    window_position: int = 0
    window_end: int = 0
    window_start: int = 0


@dataclass(frozen=True)
class Lease:
    partition: int
    partition_count: int
    owner: str
    epoch: int
    progress: Progress


@dataclass(frozen=True)
class WindowBatch:
    """The next records of a partition and where it stands once they are acknowledged
    (``following.window is None``: the window is drained, wait for new rows)."""

    records: Sequence[OutboxRecord]
    following: Progress


@dataclass(frozen=True)
class Backlog:
    """Undelivered rows of the partitions whose progress this cluster can trust, and how
    many partitions it cannot (``refused_partitions``: progress from another cluster; their
    backlog is unknown, see ``ClusterChanged``)."""

    rows: int
    oldest_age_s: float
    refused_partitions: int = 0


@dataclass(frozen=True)
class Refusal:
    partition: int
    reason: str


RESEED_HINT = (
    "its progress cannot be trusted on this cluster, so the relay will not drive it "
    "(nothing is skipped); to re-seed: stop the relays, reset relay_partition progress "
    "to pg_current_snapshot() with cluster_id = NULL, replay what may be missing with "
    "`kb relay replay --from FIRST --to LAST`, start the relays (docs/operations.md: "
    "'Re-seeding the relay')"
)


class ClusterChanged(KbError):
    """A partition's progress was recorded on another PostgreSQL cluster (or is ahead of
    this cluster's transaction counter): the relay refuses to drive it rather than skip
    rows. Why: "Progress belongs to one cluster" in services/relay/outbox_pg.py; how to
    re-seed: docs/operations.md, "Re-seeding the relay"."""

    code = "RELAY_CLUSTER_CHANGED"


@dataclass(frozen=True)
class ReplayFilter:
    after_position: int = 0
    up_to_position: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    tenant_id: str | None = None
    tier: str | None = None
    event_type: str | None = None


class LeaseStore(Protocol):
    async def ensure_partitions(self, count: int) -> None: ...

    async def acquire(self, owner: str, limit: int, lease_s: float) -> list[Lease]: ...

    async def renew(self, lease: Lease, lease_s: float) -> bool: ...

    async def commit_progress(self, lease: Lease, progress: Progress, lease_s: float) -> bool:
        """Record ``progress`` and renew; False when the lease is lost (nothing written)."""
        ...

    async def release(self, lease: Lease, progress: Progress) -> None:
        """Record ``progress`` and give the partition up (fenced: a lost lease writes nothing)."""
        ...

    async def live_owners(self) -> list[str]:
        """Owners holding a lease that has not run out (the live relay instances)."""
        ...

    async def refused_partitions(self) -> list[Refusal]:
        """Partitions ``acquire`` will not hand out because their progress belongs to
        another cluster (see ``ClusterChanged``)."""
        ...


class OutboxSource(Protocol):
    async def read_window_batch(
        self, lease: Lease, progress: Progress, limit: int
    ) -> WindowBatch: ...

    async def backlog(self) -> Backlog: ...

    async def delete_delivered(self, older_than_s: float, batch: int) -> int:
        """Delete delivered rows older than ``older_than_s``; 0 at once when another
        instance is deleting (one at a time, whichever instance gets there first)."""
        ...

    async def replay_last_position(self) -> int: ...

    async def replay_count(self, where: ReplayFilter) -> int: ...

    async def replay_batch(self, where: ReplayFilter, limit: int) -> list[OutboxRecord]: ...

    async def known_tiers(self) -> list[str]: ...


class EventSink(Protocol):
    async def start(self, tiers: Iterable[str] = ()) -> None:
        """Create the topics (where allowed) and connect; Kafka being down is no error."""
        ...

    async def send(self, records: Sequence[OutboxRecord], *, replay: bool) -> None:
        """Return once Kafka acknowledged every record (acks=all); raise otherwise."""
        ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class RelayPorts:
    """What a relay moves events with: the partition leases, the outbox it reads, the sink
    it sends to, and the wake-ups that tell it new rows were committed."""

    leases: LeaseStore
    source: OutboxSource
    sink: EventSink
    wakeups: Wakeups


class Wakeups(Protocol):
    """Coalesced "new rows committed" signals (LISTEN/NOTIFY)."""

    def subscribe(self) -> WakeupSubscription: ...

    def unsubscribe(self, subscription: WakeupSubscription) -> None: ...

    async def arm(self) -> None:
        """Ask writers to notify: a relay is about to wait. Rows committed before this
        returned may have rung no bell, so the caller reads once more before it waits.
        Never raises (a lost wake-up costs latency, the poll timer still runs)."""
        ...

    async def ensure(self) -> None:
        """(Re)connect the listener if it is down; never raises."""
        ...

    async def close(self) -> None: ...


class WakeupSubscription(Protocol):
    def clear(self) -> None: ...

    async def wait(self, within_s: float) -> bool: ...


class Subscription:
    """The ``WakeupSubscription`` a ``Wakeups`` hands out: rung by whoever learns of new
    rows (a notification), waited on by one driver."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def ring(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, within_s: float) -> bool:
        """True once rung, False when ``within_s`` passed first."""
        try:
            async with asyncio.timeout(within_s):
                await self._event.wait()
        except TimeoutError:
            return False
        return True
