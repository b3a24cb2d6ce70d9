"""In-memory stand-ins for the relay's ports.

``FakeLeaseStore`` passes the same contract tests as ``PgLeaseStore``
(tests/contract/test_relay_lease_contract.py). ``LogSource`` models the outbox as a log
whose rows become visible in position order (a "snapshot" is the highest visible position),
enough to drive the loop; the snapshot-window semantics themselves are tested against the
real PostgreSQL only.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from services.relay.ports import (
    Backlog,
    Lease,
    OutboxRecord,
    Progress,
    Refusal,
    ReplayFilter,
    Subscription,
    WindowBatch,
)
from services.runtime.errors import ConfigError, KafkaUnavailable

INITIAL_SNAPSHOT = "1:1:"


@dataclass
class _Row:
    partition: int
    partition_count: int
    owner: str | None = None
    epoch: int = 0
    lease_until: datetime | None = None
    progress: Progress = field(default_factory=lambda: Progress(delivered=INITIAL_SNAPSHOT))


class FakeLeaseStore:
    def __init__(self) -> None:
        self.rows: dict[int, _Row] = {}
        self.progress_log: list[tuple[int, int, Progress]] = []

    @staticmethod
    def _now(now: datetime | None) -> datetime:
        return now or datetime.now(UTC)

    async def ensure_partitions(self, count: int) -> None:
        if not self.rows:
            self.rows = {p: _Row(p, count) for p in range(count)}
        if len(self.rows) != count or {r.partition_count for r in self.rows.values()} != {count}:
            raise ConfigError(f"the outbox is split {len(self.rows)} ways, not {count}")

    async def acquire(
        self, owner: str, limit: int, lease_s: float, now: datetime | None = None
    ) -> list[Lease]:
        at = self._now(now)
        taken: list[Lease] = []
        for row in sorted(self.rows.values(), key=lambda r: r.partition):
            if len(taken) >= limit:
                break
            if row.owner is None or (row.lease_until is not None and row.lease_until <= at):
                row.owner, row.epoch = owner, row.epoch + 1
                row.lease_until = at + timedelta(seconds=lease_s)
                taken.append(
                    Lease(row.partition, row.partition_count, owner, row.epoch, row.progress)
                )
        return taken

    def _held(self, lease: Lease, at: datetime) -> _Row | None:
        row = self.rows[lease.partition]
        if row.owner == lease.owner and row.epoch == lease.epoch and row.lease_until is not None:
            return row if row.lease_until > at else None
        return None

    async def renew(self, lease: Lease, lease_s: float, now: datetime | None = None) -> bool:
        at = self._now(now)
        row = self._held(lease, at)
        if row is None:
            return False
        row.lease_until = at + timedelta(seconds=lease_s)
        return True

    async def commit_progress(
        self, lease: Lease, progress: Progress, lease_s: float, now: datetime | None = None
    ) -> bool:
        at = self._now(now)
        row = self._held(lease, at)
        if row is None:
            return False
        row.progress = progress
        row.lease_until = at + timedelta(seconds=lease_s)
        self.progress_log.append((lease.partition, lease.epoch, progress))
        return True

    async def release(self, lease: Lease, progress: Progress, now: datetime | None = None) -> None:
        row = self._held(lease, self._now(now))
        if row is not None:
            row.owner = row.lease_until = None
            row.progress = progress

    async def live_owners(self, now: datetime | None = None) -> list[str]:
        at = self._now(now)
        return sorted(
            {
                row.owner
                for row in self.rows.values()
                if row.owner is not None and row.lease_until is not None and row.lease_until > at
            }
        )

    async def refused_partitions(self) -> list[Refusal]:
        return []  # one "cluster" only: nothing is ever refused here

    def steal(self, partition: int, owner: str) -> None:
        """What another relay does once it took the partition over."""
        row = self.rows[partition]
        row.owner, row.epoch = owner, row.epoch + 1
        row.lease_until = datetime.now(UTC) + timedelta(hours=1)


def record(position: int, key: str = "acme/doc") -> OutboxRecord:
    return OutboxRecord(
        position=position,
        event_id=uuid.uuid4(),
        event_type="DocumentPublished",
        tenant_id="acme",
        tier="standard",
        aggregate_key=key,
        payload=b"%d" % position,
        created_at=datetime.now(UTC),
    )


class LogSource:
    """Rows visible in position order; snapshot text = the highest visible position."""

    def __init__(self) -> None:
        self.rows: list[OutboxRecord] = []

    def append(self, count: int) -> list[OutboxRecord]:
        fresh = [record(len(self.rows) + i + 1) for i in range(count)]
        self.rows.extend(fresh)
        return fresh

    @staticmethod
    def _upto(snapshot: str) -> int:
        return 0 if snapshot == INITIAL_SNAPSHOT else int(snapshot)

    async def read_window_batch(self, lease: Lease, progress: Progress, limit: int) -> WindowBatch:
        window = progress.window or str(len(self.rows))
        low = max(self._upto(progress.delivered), progress.window_position)
        rows = [
            r
            for r in self.rows
            if low < r.position <= int(window)
            and r.position % lease.partition_count == lease.partition
        ][:limit]
        if len(rows) < limit or rows[-1].position >= int(window):
            return WindowBatch(records=rows, following=Progress(delivered=window))
        return WindowBatch(
            records=rows,
            following=Progress(
                delivered=progress.delivered,
                window=window,
                window_position=rows[-1].position,
                window_end=int(window),
            ),
        )

    async def backlog(self) -> Backlog:
        return Backlog(rows=0, oldest_age_s=0.0)

    async def delete_delivered(self, older_than_s: float, batch: int) -> int:
        return 0

    async def replay_last_position(self) -> int:
        return len(self.rows)

    def _matching(self, where: ReplayFilter) -> list[OutboxRecord]:
        up_to = where.up_to_position if where.up_to_position is not None else len(self.rows)
        return [
            r
            for r in self.rows
            if where.after_position < r.position <= up_to
            and (where.tenant_id is None or r.tenant_id == where.tenant_id)
            and (where.event_type is None or r.event_type == where.event_type)
        ]

    async def replay_count(self, where: ReplayFilter) -> int:
        return len(self._matching(where))

    async def replay_batch(self, where: ReplayFilter, limit: int) -> list[OutboxRecord]:
        return self._matching(where)[:limit]

    async def known_tiers(self) -> list[str]:
        return ["standard"]


class FlakySink:
    """Acknowledges everything, except that the next ``failures`` sends fail."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.sent: list[tuple[OutboxRecord, bool]] = []
        self.attempts = 0
        self.delivered = asyncio.Event()

    async def start(self, tiers: Iterable[str] = ()) -> None:
        return None

    async def send(self, records: Sequence[OutboxRecord], *, replay: bool) -> None:
        self.attempts += 1
        if self.failures > 0:
            self.failures -= 1
            raise KafkaUnavailable("broker down (fake)")
        self.sent.extend((r, replay) for r in records)
        self.delivered.set()

    async def stop(self) -> None:
        return None


class FakeWakeups:
    def __init__(self) -> None:
        self.bells: list[Subscription] = []
        self.armed = 0
        # Runs inside arm(): what a writer committing just then would do.
        self.on_arm: Callable[[], object] | None = None

    def subscribe(self) -> Subscription:
        bell = Subscription()
        self.bells.append(bell)
        return bell

    def unsubscribe(self, subscription: object) -> None:
        self.bells = [b for b in self.bells if b is not subscription]

    def ring(self) -> None:
        for bell in self.bells:
            bell.ring()

    async def arm(self) -> None:
        self.armed += 1
        if self.on_arm is not None:
            self.on_arm()

    async def ensure(self) -> None:
        return None

    async def close(self) -> None:
        return None
