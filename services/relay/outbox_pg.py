"""PostgreSQL adapters of the relay: the outbox reader, the partition leases, LISTEN.

How the relay reads committed rows in commit order without a replication slot
-----------------------------------------------------------------------------
This is PgQ's technique (snapshot-difference batches), not a position cursor. Every
outbox row carries ``txid`` = ``pg_current_xact_id()`` of the transaction that wrote it
(the top-level transaction's id, also inside a savepoint).
Progress is a *snapshot* (``pg_current_snapshot()``), not a position. A batch ("window")
is every row whose txid is visible in the current snapshot but was not in the previous
one: ``pg_visible_in_snapshot(txid, cur) AND NOT pg_visible_in_snapshot(txid, prev)``.

Why it cannot skip a row. A position cursor skips rows because positions (sequence values)
are taken at INSERT but become visible at COMMIT, in another order: reading "position >
last" after B (position 11) committed but before A (position 10) did moves the cursor past
10 for good. Snapshots instead describe *which transactions had committed*, whatever
their positions. Snapshots taken one after another on the primary see ever more
transactions, so the windows (prev, cur] partition the committed transactions: a
transaction still open at ``cur`` is in its in-progress list (or not even assigned a txid,
which then is >= its xmax), hence invisible in ``cur``; once it commits it is visible in a
later snapshot, and since it was not visible in that ``cur`` (our next ``prev``) it falls
into exactly that later window. Its rows are delivered with the window, whatever their
positions. Aborted transactions' rows do not exist. The window is fixed when opened (all
its transactions have finished), so paging through it by position with a LIMIT sees a
stable set, and ``window_position`` is a safe resume point inside it.

Why it does not stall behind a long-open transaction. An open transaction only keeps its
own txid out of the windows; rows of transactions that committed after it started are
visible in the next snapshot and go out with it. And "not visible in prev" is read as
"txid in prev's in-progress list, or txid >= prev's xmax", two index ranges, so the long
transaction does not widen the scan either.

Commit order. Every row of window N committed before snapshot N was taken and every row of
window N+1 after it, so windows follow commit order. Inside a window rows go out in
position order, which is commit order for rows of one document: ``add_event`` makes the
writers of one aggregate key wait for each other (services/runtime/messaging/outbox.sql), so a later
commit takes a higher position.

Cost. Opening a window takes its snapshot, finds its position range and reads its first
rows in one statement (index probes and one range on the txid index); the rest is read in
bounded position ranges (primary-key ranges), so a read costs what its range holds, never
the whole window again, and a big backlog drains in time linear in its size. A late
committer (a transaction open at the previous snapshot) may have inserted its rows long
before it committed, far below the window's other rows: below ``window_start`` the window
holds only such rows, and they are read by txid, so the delivered rows in between are
never read again (migrations/0008). Because every access path is fixed by those bounds,
relay connections use ``plan_cache_mode = force_generic_plan``: planning each statement
anew (what PostgreSQL would otherwise do for these, the custom plans looking cheaper)
costs more than running it at a thousand wake-ups a second.

Progress belongs to one cluster
-------------------------------
Snapshots and ``outbox.txid`` are transaction ids: they mean something only within the
transaction history of the cluster that assigned them. After a pg_dump/restore, logical
replication or a managed blue/green switchover the new cluster's counter may be *behind*
the stored snapshots; new rows would then look "already delivered" and be skipped in
silence. So every partition records the cluster its progress was made on
(``relay_partition.cluster_id`` = ``pg_control_system().system_identifier``, migration
0005), and the relay refuses to drive a partition whose progress comes from another
cluster or is ahead of this cluster's counter (``pg_snapshot_xmax(delivered) >
pg_snapshot_xmax(pg_current_snapshot())``): ``acquire_leases`` does not hand it out, the
supervisor logs ``relay.cluster_changed`` at error and sets ``kb_relay_refused_partitions``
(the backlog gauges turn NaN: unknown), retention deletes nothing, and it keeps trying.
Progress writes are guarded the same way (a relay whose connections now reach another
cluster writes nothing), ``delivered`` never moves backwards, and a window opened behind
the delivered snapshot is an error, not "nothing new". A partition without a recorded
cluster (new, or progress from before migration 0005) records the one it runs on. Only an
operator re-seeds a refused partition (docs/operations.md: "Re-seeding the relay").
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import asyncpg

from services.relay.ports import (
    RESEED_HINT,
    Backlog,
    ClusterChanged,
    Lease,
    OutboxRecord,
    Progress,
    Refusal,
    ReplayFilter,
    Subscription,
    WindowBatch,
)
from services.runtime.errors import ConfigError
from services.runtime.logging import get_logger
from services.runtime.pg.db import create_pool, translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside
from services.runtime.settings import RuntimeSettings

QUERIES = queries_beside(__file__, "queries.sql")
NOTIFY_CHANNEL = "kb_outbox"

log = get_logger(__name__)


async def create_relay_pool(settings: RuntimeSettings, **overrides: Any) -> asyncpg.Pool[Any]:
    return await create_pool(
        settings,
        server_settings={
            "application_name": "kb-relay",
            "statement_timeout": str(settings.db_statement_timeout_ms),
            "plan_cache_mode": "force_generic_plan",
        },
        **overrides,
    )


def _record(row: asyncpg.Record) -> OutboxRecord:
    return from_row(OutboxRecord, row, payload=bytes(row["payload"]))


def _read_up_to(progress: Progress, span: int) -> int:
    """The last position the next read of the open window covers: ``span`` positions
    past what is acknowledged, counted from ``window_start`` (below which only late
    committers' rows are read, by txid)."""
    start = max(progress.window_position, progress.window_start - 1)
    return min(progress.window_end, start + span)


def _lease_and_progress(lease: Lease, progress: Progress) -> tuple[Any, ...]:
    """$1 to $6 of the fenced progress writes (commit_progress, release_lease): the lease
    (partition, owner, epoch) and where the partition stands."""
    return (
        lease.partition,
        lease.owner,
        lease.epoch,
        progress.delivered,
        progress.window,
        progress.window_position,
    )


def snapshot_xmax(snapshot: str) -> int:
    """The xmax of a snapshot in its text form ``xmin:xmax:xip,xip,...``."""
    return int(snapshot.split(":")[1])


def in_progress_txids(snapshot: str) -> list[str]:
    """The in-progress list of a snapshot in its text form ``xmin:xmax:xip,xip,...``."""
    _, _, listed = snapshot.split(":")
    return [txid for txid in listed.split(",") if txid]


class PgLeaseStore:
    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool

    async def ensure_partitions(self, count: int) -> None:
        with translate_db_errors():
            await self._pool.execute(QUERIES["insert_partitions"], count)
            layout = await self._pool.fetchrow(QUERIES["partition_layout"])
        assert layout is not None
        if layout["partitions"] != count or layout["min_count"] != layout["max_count"]:
            raise ConfigError(
                f"KB_RELAY_PARTITIONS={count} but relay_partition holds "
                f"{layout['partitions']} partitions of a {layout['max_count']}-way split; "
                "the partition count cannot change once events flowed"
            )
        if layout["max_count"] != count:
            raise ConfigError(
                f"KB_RELAY_PARTITIONS={count} but the outbox is split {layout['max_count']} ways"
            )

    async def acquire(self, owner: str, limit: int, lease_s: float, now: Any = None) -> list[Lease]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["acquire_leases"], owner, limit, lease_s, now)
        return [
            Lease(
                partition=row["partition"],
                partition_count=row["partition_count"],
                owner=owner,
                epoch=row["epoch"],
                progress=Progress(
                    delivered=row["delivered_snapshot"],
                    window=row["window_snapshot"],
                    window_position=row["window_position"],
                    window_end=row["window_end"],
                    window_start=row["window_start"],
                ),
            )
            for row in rows
        ]

    async def renew(self, lease: Lease, lease_s: float, now: Any = None) -> bool:
        with translate_db_errors():
            renewed = await self._pool.fetchval(
                QUERIES["renew_lease"], lease.partition, lease.owner, lease.epoch, lease_s, now
            )
        return renewed is not None

    async def _refuse_if_other_cluster(self, lease: Lease) -> None:
        """After a guarded write touched nothing: a lost lease (return) or a partition
        whose progress belongs to another cluster (raise ClusterChanged)."""
        with translate_db_errors():
            reason = await self._pool.fetchval(QUERIES["partition_refusal"], lease.partition)
        if reason is not None:
            raise ClusterChanged(f"relay partition {lease.partition}: {reason}; {RESEED_HINT}")

    async def live_owners(self, now: Any = None) -> list[str]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["live_owners"], now)
        return [row["owner"] for row in rows]

    async def refused_partitions(self) -> list[Refusal]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["refused_partitions"])
        return [Refusal(partition=row["partition"], reason=row["reason"]) for row in rows]

    async def commit_progress(
        self, lease: Lease, progress: Progress, lease_s: float, now: Any = None
    ) -> bool:
        """Record ``progress`` and renew; False when the lease is lost. Raises
        ClusterChanged when the progress belongs to another cluster."""
        with translate_db_errors():
            done = await self._pool.fetchval(
                QUERIES["commit_progress"],
                *_lease_and_progress(lease, progress),
                lease_s,
                now,
                progress.window_end,
                progress.window_start,
            )
        if done is None:
            await self._refuse_if_other_cluster(lease)
        return done is not None

    async def release(self, lease: Lease, progress: Progress, now: Any = None) -> None:
        with translate_db_errors():
            await self._pool.execute(
                QUERIES["release_lease"],
                *_lease_and_progress(lease, progress),
                now,
                progress.window_end,
                progress.window_start,
            )


class PgOutboxSource:
    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool

    async def read_window_batch(self, lease: Lease, progress: Progress, limit: int) -> WindowBatch:
        """Up to ``limit`` records of the partition's window, opening the next window first
        when none is open. A read covers at most ``limit * partition_count`` positions from
        ``window_start`` on (below it, only late committers' rows, found by txid), so its
        cost is bounded; it may come back empty while the window is not drained yet."""
        span = limit * max(1, lease.partition_count)
        late_txids = in_progress_txids(progress.delivered)
        with translate_db_errors():
            if progress.window is None:
                snapshot, opened, rows = await self._open_window(
                    lease, progress, late_txids, limit, span
                )
                if opened is None:  # nothing new: the window is done
                    return WindowBatch(records=[], following=Progress(delivered=snapshot))
                progress = opened
                up_to = _read_up_to(progress, span)
            else:
                up_to = _read_up_to(progress, span)
                rows = await self._pool.fetch(
                    QUERIES["read_window_batch"],
                    lease.partition_count,
                    lease.partition,
                    progress.delivered,
                    progress.window,
                    progress.window_position,
                    up_to,
                    limit,
                    late_txids,
                    progress.window_start,
                )
        assert progress.window is not None
        records = [_record(row) for row in rows]
        reached = records[-1].position if len(records) == limit else up_to
        if reached >= progress.window_end:
            return WindowBatch(records=records, following=Progress(delivered=progress.window))
        return WindowBatch(
            records=records, following=dataclasses.replace(progress, window_position=reached)
        )

    async def _open_window(
        self, lease: Lease, progress: Progress, late_txids: list[str], limit: int, span: int
    ) -> tuple[str, Progress | None, list[asyncpg.Record]]:
        """Open the next window: its snapshot, where it stands (None: nothing new, the
        partition is delivered up to that snapshot) and its first rows."""
        rows = await self._pool.fetch(
            QUERIES["open_window"],
            lease.partition_count,
            lease.partition,
            progress.delivered,
            late_txids,
            limit,
            span,
        )
        opened = rows[0]
        if snapshot_xmax(opened["window_snapshot"]) < snapshot_xmax(progress.delivered):
            # This cluster's counter is behind the progress: another cluster's.
            raise ClusterChanged(
                f"relay partition {lease.partition}: the current snapshot "
                f"{opened['window_snapshot']} is behind the delivered one "
                f"{progress.delivered}; {RESEED_HINT}"
            )
        if opened["first_position"] is None:
            return opened["window_snapshot"], None, []
        window = Progress(
            delivered=progress.delivered,
            window=opened["window_snapshot"],
            window_position=opened["first_position"] - 1,
            window_end=opened["last_position"],
            window_start=opened["window_start"],
        )
        return (
            opened["window_snapshot"],
            window,
            [row for row in rows if row["position"] is not None],
        )

    async def backlog(self, now: Any = None) -> Backlog:
        with translate_db_errors():
            partitions = await self._pool.fetchrow(QUERIES["backlog_floor"])
            assert partitions is not None
            refused: int = partitions["refused"]
            if partitions["floor"] is None:  # no relay ever ran here (or all refused)
                return Backlog(rows=0, oldest_age_s=0.0, refused_partitions=refused)
            row = await self._pool.fetchrow(QUERIES["backlog"], now, partitions["floor"])
        assert row is not None
        return Backlog(
            rows=row["backlog_rows"],
            oldest_age_s=row["oldest_age_s"],
            refused_partitions=refused,
        )

    async def delete_delivered(self, older_than_s: float, batch: int, now: Any = None) -> int:
        """Delete delivered rows older than ``older_than_s`` in position ranges of
        ``batch``, each its own short statement, holding the retention lock (another
        instance holding it: 0 at once). Returns how many rows went."""
        with translate_db_errors():
            async with self._pool.acquire() as pooled:
                conn: asyncpg.Connection[Any] = pooled  # type: ignore[assignment]
                if not await conn.fetchval(QUERIES["try_retention_lock"]):
                    return 0
                try:
                    return await _delete_delivered(conn, older_than_s, batch, now)
                finally:
                    await conn.fetchval(QUERIES["retention_unlock"])

    async def replay_last_position(self) -> int:
        with translate_db_errors():
            value: int = await self._pool.fetchval(QUERIES["replay_last_position"])
        return value

    def _replay_args(self, where: ReplayFilter) -> Sequence[Any]:
        return (
            where.after_position,
            where.up_to_position,
            where.since,
            where.until,
            where.tenant_id,
            where.tier,
            where.event_type,
        )

    async def replay_count(self, where: ReplayFilter) -> int:
        with translate_db_errors():
            value: int = await self._pool.fetchval(
                QUERIES["replay_count"], *self._replay_args(where)
            )
        return value

    async def replay_batch(self, where: ReplayFilter, limit: int) -> list[OutboxRecord]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["replay_batch"], *self._replay_args(where), limit)
        return [_record(row) for row in rows]

    async def known_tiers(self) -> list[str]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["known_tiers"])
        return [row["tier"] for row in rows]


async def _delete_delivered(
    conn: asyncpg.Connection[Any], older_than_s: float, batch: int, now: Any
) -> int:
    cutoff = await conn.fetchval(QUERIES["retention_cutoff"], now, older_than_s)
    bounds = await conn.fetchrow(QUERIES["retention_range"], cutoff)
    assert bounds is not None
    if bounds["low"] is None:
        return 0
    deleted = 0
    low: int = bounds["low"]
    while low <= bounds["high"]:
        status = await conn.execute(QUERIES["delete_delivered"], low, low + batch, cutoff)
        deleted += int(status.split()[-1])
        low += batch
        await asyncio.sleep(0)  # let the live relay's work interleave
    return deleted


class PgWakeups:
    """LISTEN on a dedicated connection; every notification rings every subscriber.

    It also works the doorbell (migrations/0008): ``arm`` before a driver waits, disarm
    when a notification arrives, so writers notify only while some relay waits. Both
    run on the listening connection, one statement at a time (the disarm of a
    notification is queued before the re-arm of the drivers it wakes).

    Losing the connection only costs latency (the relay polls on a timer); ``ensure``
    reconnects, the relay calls it on each supervision tick.
    """

    def __init__(self, settings: RuntimeSettings) -> None:
        self._settings = settings
        self._conn: asyncpg.Connection[Any] | None = None
        self._subscriptions: list[Subscription] = []
        self._statement = asyncio.Lock()
        self._disarming: set[asyncio.Task[None]] = set()

    def subscribe(self) -> Subscription:
        subscription = Subscription()
        self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: object) -> None:
        self._subscriptions = [s for s in self._subscriptions if s is not subscription]

    def _notified(self, *_: object) -> None:
        disarm = asyncio.create_task(self._doorbell("disarm_doorbell"))
        self._disarming.add(disarm)
        disarm.add_done_callback(self._disarming.discard)
        for subscription in self._subscriptions:
            subscription.ring()

    async def arm(self) -> None:
        await self._doorbell("arm_doorbell")

    async def _doorbell(self, query: str) -> None:
        async with self._statement:
            conn = self._conn
            if conn is None or conn.is_closed():
                return
            try:
                await conn.execute(QUERIES[query])
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as error:
                log.warning("relay.doorbell_failed", action=query, error=str(error))

    async def ensure(self) -> None:
        if self._conn is not None and not self._conn.is_closed():
            return
        try:
            with translate_db_errors():
                conn: asyncpg.Connection[Any] = await asyncpg.connect(
                    self._settings.database_url,
                    server_settings={"application_name": "kb-relay-listen"},
                )
                await conn.add_listener(NOTIFY_CHANNEL, self._notified)
        except Exception as error:
            log.warning("relay.listen_failed", error=str(error))
            return
        self._conn = conn
        # Anything committed while we were not listening: look now.
        self._notified()

    async def close(self) -> None:
        for task in list(self._disarming):
            task.cancel()
        if self._conn is not None:
            conn, self._conn = self._conn, None
            if not conn.is_closed():
                try:
                    await conn.close(timeout=5)
                except Exception:
                    conn.terminate()
