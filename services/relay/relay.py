"""The relay loop: committed outbox rows to Kafka, per leased partition, in commit order.

A thin public API (``start``/``stop``, or ``async with``) over a background supervisor
and one driver task per leased partition, with a small state machine:

    CREATED -> RUNNING -> STOPPING -> STOPPED

The supervisor acquires free partitions (up to ``relay_max_partitions_per_instance``),
starts a driver for each, keeps the LISTEN connection up, runs retention and refreshes
the backlog gauges. A driver repeats: read the next batch of its partition's current
snapshot window (see ``outbox_pg.py`` for why windows never skip a row), send it, wait for
Kafka's acknowledgement, and only then record progress with a write fenced on the lease's
owner and epoch. Kafka or PostgreSQL being down means: back off (exponential, capped,
jittered), keep renewing the lease, retry the same batch; nothing is lost and nothing
crashes. A driver stops as soon as its lease is lost, by its own clock (which runs out
before the database's) or because a fenced write touched no row.

A send never outlasts the lease: a driver starts one only when it ends (the sink's
``relay_send_timeout_s``, failure and producer close included) before the lease time it
trusts, renewing first when the time left is too short, and it gives a send up (and
stops driving) should one still run past that time. Another relay can therefore only
take the partition over once this one can no longer put anything on Kafka for it. In one
process, a partition taken again while its old driver still runs gets its old driver
cancelled and awaited before the new one starts.

A partition whose progress belongs to another PostgreSQL cluster is never driven (see
"Progress belongs to one cluster" in ``outbox_pg.py``): the supervisor reports it
(``relay.cluster_changed``, ``kb_relay_refused_partitions``) until it is re-seeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import random
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

from services.relay import metrics
from services.relay.ports import (
    RESEED_HINT,
    ClusterChanged,
    EventSink,
    Lease,
    LeaseStore,
    OutboxRecord,
    OutboxSource,
    Wakeups,
    WakeupSubscription,
)
from services.relay.settings import LOCAL_LEASE_SHARE, RelaySettings
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)

# Test-only seam: awaited after Kafka acknowledged a batch and before its progress is
# recorded (None in production). Tests use it to observe or to crash at that point.
AfterAck = Callable[[Lease, Sequence[OutboxRecord]], Awaitable[None]]


class RelayState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Relay:
    def __init__(
        self,
        settings: RelaySettings,
        *,
        leases: LeaseStore,
        source: OutboxSource,
        sink: EventSink,
        wakeups: Wakeups,
        owner: str | None = None,
        after_ack: AfterAck | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings
        self.owner = owner or default_owner()
        self.state = RelayState.CREATED
        self._leases = leases
        self._source = source
        self._sink = sink
        self._wakeups = wakeups
        self._after_ack = after_ack
        self._stopping = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        # Test-only seam: the monotonic clock leases are timed with (None: the loop's).
        self._clock = clock or _loop_time
        self._drivers: dict[int, asyncio.Task[None]] = {}
        # partition -> epoch of the lease its current driver holds.
        self._driving: dict[int, int] = {}
        self._refused: frozenset[int] = frozenset()
        self._rounds = 0
        self._refused_logged_at = float("-inf")
        self._retention: asyncio.Task[None] | None = None
        # Set when the relay gave up on a non-retriable start-up error (configuration).
        self.failure: KbError | None = None
        self._partitions_changed = asyncio.Condition()

    # --- public API -----------------------------------------------------------------------

    @property
    def partitions(self) -> set[int]:
        """Partitions this instance drives right now."""
        return set(self._driving)

    async def wait_for_partitions(self, count: int) -> None:
        """Until this instance drives exactly ``count`` partitions (tests, health checks)."""
        async with self._partitions_changed:
            await self._partitions_changed.wait_for(lambda: len(self.partitions) == count)

    @property
    def rounds(self) -> int:
        """Supervision rounds completed (each one tried to take free partitions)."""
        return self._rounds

    async def wait_for_rounds(self, count: int) -> None:
        """Until the supervisor has completed ``count`` rounds (tests, health checks)."""
        async with self._partitions_changed:
            await self._partitions_changed.wait_for(lambda: self._rounds >= count)

    async def _announce_partitions(self) -> None:
        metrics.LEASES_HELD.set(len(self.partitions))
        async with self._partitions_changed:
            self._partitions_changed.notify_all()

    async def start(self) -> None:
        if self.state is not RelayState.CREATED:
            raise RuntimeError(f"relay is {self.state.value}, cannot start")
        self.state = RelayState.RUNNING
        self._supervisor = asyncio.create_task(self._supervise(), name="relay-supervisor")
        log.info("relay.started", owner=self.owner)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Finish the batches in flight (within ``grace_s``), release the leases, close."""
        if self.state in (RelayState.STOPPING, RelayState.STOPPED):
            return
        self.state = RelayState.STOPPING
        self._stopping.set()
        tasks = [t for t in (self._supervisor, self._retention) if t is not None]
        tasks += list(self._drivers.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._sink.stop()
        await self._wakeups.close()
        metrics.LEASES_HELD.set(0)
        self.state = RelayState.STOPPED
        log.info("relay.stopped", owner=self.owner)

    async def wait_stopped(self) -> None:
        if self._supervisor is not None:
            await asyncio.gather(self._supervisor, return_exceptions=True)

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- supervisor -----------------------------------------------------------------------

    async def _supervise(self) -> None:
        s = self.settings
        cap = s.relay_max_partitions_per_instance or s.relay_partitions
        tick = min(s.relay_lease_s / 3, s.relay_poll_interval_s)
        backoff = _Backoff(s.relay_backoff_initial_s, s.relay_backoff_max_s)
        driver_backoff = _Backoff(s.relay_backoff_initial_s, s.relay_backoff_max_s)
        driver_backoff_until = 0.0
        clock = self._clock
        started = False
        next_retention = clock() + min(s.relay_retention_interval_s, 5.0)
        next_metrics = clock()
        while not self._stopping.is_set():
            try:
                if not started:
                    await self._leases.ensure_partitions(s.relay_partitions)
                    tiers = set(s.relay_topic_tiers) | set(await self._source.known_tiers())
                    await self._sink.start(sorted(tiers))
                    started = True
                await self._wakeups.ensure()
                failed = self._reap_drivers()
                wanted = cap - len(self._drivers)
                if failed:
                    # A driver died of a non-retriable error (a bug, a broken row): do not
                    # spin on it; take partitions again after a growing pause.
                    wanted = 0
                    driver_backoff_until = clock() + driver_backoff.next()
                elif clock() < driver_backoff_until:
                    wanted = 0
                if wanted > 0:
                    asked = clock()  # the lease runs from before the request, to be safe
                    for lease in await self._leases.acquire(self.owner, wanted, s.relay_lease_s):
                        metrics.LEASE_CHANGES.labels(change="acquired").inc()
                        log.info(
                            "lease.acquired",
                            owner=self.owner,
                            partition=lease.partition,
                            epoch=lease.epoch,
                        )
                        # Our old driver of this partition may still run (stuck past its
                        # lease): it is cancelled, and the new one waits for it to end.
                        previous = self._drivers.get(lease.partition)
                        if previous is not None:
                            previous.cancel()
                        self._driving[lease.partition] = lease.epoch
                        self._drivers[lease.partition] = asyncio.create_task(
                            self._drive(lease, acquired_at=asked, after=previous),
                            name=f"relay-partition-{lease.partition}",
                        )
                    await self._announce_partitions()
                now = clock()
                if now >= next_retention and 0 in self.partitions:
                    next_retention = now + s.relay_retention_interval_s
                    if self._retention is None or self._retention.done():
                        self._retention = asyncio.create_task(self._run_retention())
                if now >= next_metrics:
                    next_metrics = now + s.relay_metrics_interval_s
                    backlog = await self._source.backlog()
                    metrics.REFUSED_PARTITIONS.set(backlog.refused_partitions)
                    if backlog.refused_partitions:
                        # Unknown, not 0: those partitions' progress means nothing here.
                        metrics.BACKLOG_ROWS.set(float("nan"))
                        metrics.OLDEST_UNDELIVERED_AGE.set(float("nan"))
                        await self._report_refused()
                    else:
                        metrics.BACKLOG_ROWS.set(backlog.rows)
                        metrics.OLDEST_UNDELIVERED_AGE.set(backlog.oldest_age_s)
                        self._refused = frozenset()
                backoff.reset()
                delay = tick
                self._rounds += 1
                await self._announce_partitions()
            except Exception as error:
                if not isinstance(error, KbError):
                    # A bug, not an outage: say so, stop, and let the process exit non-zero.
                    log.exception("relay.crashed")
                    self.failure = KbError(f"relay supervisor crashed: {error!r}")
                    self._stopping.set()
                    break
                if not error.retriable and not started:
                    # Misconfiguration (partition count): no point retrying; say so and stop.
                    log.error("relay.cannot_start", error=str(error), code=error.code)
                    self.failure = error
                    self._stopping.set()
                    break
                log.warning("relay.supervisor_retry", error=str(error), code=error.code)
                delay = backoff.next()
            await self._sleep(delay)
        # Drivers notice `_stopping` themselves and release their leases.

    async def _report_refused(self) -> None:
        """Log the partitions refused for another cluster's progress: when the set changes,
        and again every minute while it lasts."""
        refusals = await self._leases.refused_partitions()
        refused = frozenset(r.partition for r in refusals)
        now = self._clock()
        if refused == self._refused and now - self._refused_logged_at < 60.0:
            return
        self._refused, self._refused_logged_at = refused, now
        for refusal in refusals:
            log.error(
                "relay.cluster_changed",
                owner=self.owner,
                partition=refusal.partition,
                reason=refusal.reason,
                hint=RESEED_HINT,
            )

    def _reap_drivers(self) -> bool:
        """Forget finished drivers; True when one of them died of an error."""
        failed = False
        for partition, task in list(self._drivers.items()):
            if not task.done():
                continue
            del self._drivers[partition]
            if not task.cancelled() and task.exception() is not None:
                failed = True
                log.error(
                    "relay.partition_failed",
                    partition=partition,
                    error=repr(task.exception()),
                )
        return failed

    async def _run_retention(self) -> None:
        s = self.settings
        try:
            deleted = await self._source.delete_delivered(
                s.relay_retention_hours * 3600, s.relay_retention_batch
            )
        except KbError as error:
            log.warning("relay.retention_failed", error=str(error), code=error.code)
            return
        if deleted:
            metrics.RETENTION_DELETED.inc(deleted)
            log.info("relay.retention_deleted", rows=deleted)

    # --- one partition --------------------------------------------------------------------

    async def _drive(
        self, lease: Lease, *, acquired_at: float, after: asyncio.Task[None] | None = None
    ) -> None:
        if after is not None:
            # Our previous driver of this partition (cancelled by the supervisor): it must
            # be gone before this one sends anything.
            await asyncio.gather(after, return_exceptions=True)
        s = self.settings
        clock = self._clock
        share = s.relay_lease_s * LOCAL_LEASE_SHARE
        trusted_until = acquired_at + share
        renew_every = s.relay_lease_s / 3
        last_renewed = last_saved = acquired_at
        save_every = s.relay_progress_interval_s
        unsaved = False
        progress = lease.progress
        backoff = _Backoff(s.relay_backoff_initial_s, s.relay_backoff_max_s)
        subscription = self._wakeups.subscribe()
        lost = refused = False
        try:
            while not self._stopping.is_set():
                if clock() >= trusted_until:
                    lost = True
                    break
                subscription.clear()
                try:
                    batch = await self._source.read_window_batch(
                        lease, progress, s.relay_batch_size
                    )
                    records = batch.records
                    if records:
                        # A send may only start when it ends (relay_send_timeout_s, its
                        # failure included) before the lease time we trust: past it another
                        # relay may drive this partition. Renew first when that is too close.
                        if clock() + s.relay_send_timeout_s >= trusted_until:
                            asked = clock()
                            if not await self._leases.renew(lease, s.relay_lease_s):
                                lost = True
                                break
                            last_renewed = asked
                            trusted_until = asked + share
                            if clock() + s.relay_send_timeout_s >= trusted_until:
                                # The renewal itself took too long: try again later.
                                await self._sleep(backoff.next())
                                continue
                        if not await self._send_within(records, trusted_until - clock()):
                            log.error(
                                "relay.send_outlived_lease",
                                owner=self.owner,
                                partition=lease.partition,
                                epoch=lease.epoch,
                            )
                            lost = True
                            break
                        if self._after_ack is not None:
                            await self._after_ack(lease, records)
                    drained = batch.following.window is None
                    progress = batch.following
                    unsaved = unsaved or bool(records)
                    now = clock()
                    # Progress is written only for acknowledged batches, at most every
                    # relay_progress_interval_s (a crash re-sends at most that much: at
                    # least once), and at every lease renewal, which it doubles as.
                    if (unsaved and now - last_saved >= save_every) or (
                        now - last_renewed >= renew_every
                    ):
                        if not await self._leases.commit_progress(lease, progress, s.relay_lease_s):
                            lost = True
                            break
                        last_renewed = last_saved = now
                        unsaved = False
                        trusted_until = now + share
                    backoff.reset()
                except ClusterChanged as error:
                    # Progress from another cluster: never drive on it (rows would be
                    # skipped); the supervisor keeps reporting it until it is re-seeded.
                    log.error(
                        "relay.cluster_changed",
                        owner=self.owner,
                        partition=lease.partition,
                        epoch=lease.epoch,
                        error=error.message,
                    )
                    refused = True
                    break
                except KbError as error:
                    if not error.retriable:
                        raise
                    log.warning(
                        "relay.batch_retry",
                        partition=lease.partition,
                        error=str(error),
                        code=error.code,
                    )
                    if clock() - last_renewed >= renew_every:
                        asked = clock()
                        with contextlib.suppress(KbError):
                            if not await self._leases.renew(lease, s.relay_lease_s):
                                lost = True
                                break
                            last_renewed = asked
                            trusted_until = asked + share
                    await self._sleep(min(backoff.next(), max(0.0, trusted_until - clock())))
                    continue
                if drained:
                    now = clock()
                    wait = min(s.relay_poll_interval_s, renew_every - (now - last_renewed))
                    if unsaved:
                        wait = min(wait, save_every - (now - last_saved))
                    await self._wait_for_rows(subscription, max(0.0, wait))
        finally:
            self._wakeups.unsubscribe(subscription)
            # Only our own entry: the partition may be driven by a newer lease already.
            if self._driving.get(lease.partition) == lease.epoch:
                del self._driving[lease.partition]
            await self._announce_partitions()
            if lost or refused:
                metrics.LEASE_CHANGES.labels(change="lost").inc()
                log.warning(
                    "lease.lost", owner=self.owner, partition=lease.partition, epoch=lease.epoch
                )
            else:
                with contextlib.suppress(KbError):
                    await self._leases.release(lease, progress)
                metrics.LEASE_CHANGES.labels(change="released").inc()
                log.info(
                    "lease.released",
                    owner=self.owner,
                    partition=lease.partition,
                    epoch=lease.epoch,
                )

    async def _send_within(self, records: Sequence[OutboxRecord], within_s: float) -> bool:
        """Send, giving the send up when it runs past ``within_s`` (False): the sink keeps
        to relay_send_timeout_s, this only guards against one that does not."""
        try:
            async with asyncio.timeout(within_s) as deadline:
                await self._sink.send(records, replay=False)
        except TimeoutError:
            if deadline.expired():
                return False
            raise
        return True

    # --- waiting --------------------------------------------------------------------------

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the relay is stopping."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def _wait_for_rows(self, subscription: WakeupSubscription, within_s: float) -> None:
        """Until a notification, the poll timer, or stop: whichever comes first."""
        rang = asyncio.create_task(subscription.wait(within_s))
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({rang, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (rang, stopping):
                task.cancel()
            await asyncio.gather(rang, stopping, return_exceptions=True)


class _Backoff:
    """Exponential backoff with a cap and full jitter."""

    def __init__(self, initial: float, cap: float) -> None:
        self._initial = initial
        self._cap = cap
        self._current = initial

    def reset(self) -> None:
        self._current = self._initial

    def next(self) -> float:
        delay = random.uniform(self._current / 2, self._current)
        self._current = min(self._cap, self._current * 2)
        return delay
