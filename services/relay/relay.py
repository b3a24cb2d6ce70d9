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
        self._drivers: dict[int, asyncio.Task[None]] = {}
        self._driving: set[int] = set()
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
        loop = asyncio.get_running_loop()
        started = False
        next_retention = loop.time() + min(s.relay_retention_interval_s, 5.0)
        next_metrics = loop.time()
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
                    driver_backoff_until = loop.time() + driver_backoff.next()
                elif loop.time() < driver_backoff_until:
                    wanted = 0
                if wanted > 0:
                    asked = loop.time()  # the lease runs from before the request, to be safe
                    for lease in await self._leases.acquire(self.owner, wanted, s.relay_lease_s):
                        metrics.LEASE_CHANGES.labels(change="acquired").inc()
                        log.info(
                            "lease.acquired",
                            owner=self.owner,
                            partition=lease.partition,
                            epoch=lease.epoch,
                        )
                        self._driving.add(lease.partition)
                        self._drivers[lease.partition] = asyncio.create_task(
                            self._drive(lease, acquired_at=asked),
                            name=f"relay-partition-{lease.partition}",
                        )
                    await self._announce_partitions()
                now = loop.time()
                if now >= next_retention and 0 in self.partitions:
                    next_retention = now + s.relay_retention_interval_s
                    if self._retention is None or self._retention.done():
                        self._retention = asyncio.create_task(self._run_retention())
                if now >= next_metrics:
                    next_metrics = now + s.relay_metrics_interval_s
                    backlog = await self._source.backlog()
                    metrics.BACKLOG_ROWS.set(backlog.rows)
                    metrics.OLDEST_UNDELIVERED_AGE.set(backlog.oldest_age_s)
                backoff.reset()
                delay = tick
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

    async def _drive(self, lease: Lease, *, acquired_at: float) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        trusted_until = acquired_at + s.relay_lease_s * LOCAL_LEASE_SHARE
        renew_every = s.relay_lease_s / 3
        last_renewed = last_saved = acquired_at
        save_every = s.relay_progress_interval_s
        unsaved = False
        progress = lease.progress
        backoff = _Backoff(s.relay_backoff_initial_s, s.relay_backoff_max_s)
        subscription = self._wakeups.subscribe()
        lost = False
        try:
            while not self._stopping.is_set():
                if loop.time() >= trusted_until:
                    lost = True
                    break
                subscription.clear()
                try:
                    batch = await self._source.read_window_batch(
                        lease, progress, s.relay_batch_size
                    )
                    records = batch.records
                    if records:
                        # Past the lease's trusted time nothing may be sent: another relay
                        # may drive this partition by now.
                        if loop.time() >= trusted_until:
                            lost = True
                            break
                        await self._sink.send(records, replay=False)
                        if self._after_ack is not None:
                            await self._after_ack(lease, records)
                    drained = batch.following.window is None
                    progress = batch.following
                    unsaved = unsaved or bool(records)
                    now = loop.time()
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
                        trusted_until = now + s.relay_lease_s * LOCAL_LEASE_SHARE
                    backoff.reset()
                except KbError as error:
                    if not error.retriable:
                        raise
                    log.warning(
                        "relay.batch_retry",
                        partition=lease.partition,
                        error=str(error),
                        code=error.code,
                    )
                    if loop.time() - last_renewed >= renew_every:
                        asked = loop.time()
                        with contextlib.suppress(KbError):
                            if not await self._leases.renew(lease, s.relay_lease_s):
                                lost = True
                                break
                            last_renewed = asked
                            trusted_until = asked + s.relay_lease_s * LOCAL_LEASE_SHARE
                    await self._sleep(min(backoff.next(), max(0.0, trusted_until - loop.time())))
                    continue
                if drained:
                    now = loop.time()
                    wait = min(s.relay_poll_interval_s, renew_every - (now - last_renewed))
                    if unsaved:
                        wait = min(wait, save_every - (now - last_saved))
                    await self._wait_for_rows(subscription, max(0.0, wait))
        finally:
            self._wakeups.unsubscribe(subscription)
            self._driving.discard(lease.partition)
            await self._announce_partitions()
            if lost:
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
