"""The relay loop: committed outbox rows to Kafka, per leased partition, in commit order.

A thin public API (``start``/``stop``, or ``async with``) over a background supervisor
and one driver task per leased partition (``driver.py``), with a small state machine:

    CREATED -> RUNNING -> STOPPING -> STOPPED

The supervisor acquires free partitions (up to ``relay_max_partitions_per_instance``),
starts a driver for each, keeps the LISTEN connection up, runs retention (any instance
may; the store lets one delete at a time) and refreshes the gauges, warning when the live
instances at their cap cannot drive every partition. Outages are retried with backoff; a
bug or a misconfiguration stops the relay with ``failure`` set. In one process, a
partition taken again while its old driver still runs gets its old driver cancelled and
awaited before the new one starts.

A partition whose progress belongs to another PostgreSQL cluster is never driven (see
"Progress belongs to one cluster" in ``outbox_pg.py``): the supervisor reports it
(``relay.cluster_changed``, ``kb_relay_refused_partitions``) until it is re-seeded.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from types import TracebackType

from services.relay import metrics
from services.relay.driver import AfterAck, PartitionDriver, Step, sleep_unless
from services.relay.gauges import Gauges
from services.relay.ports import (
    EventSink,
    Lease,
    LeaseStore,
    OutboxSource,
    RelayPorts,
    Wakeups,
)
from services.relay.settings import RelaySettings
from services.runtime.errors import KbError
from services.runtime.identity import owner_id
from services.runtime.logging import get_logger

__all__ = ["AfterAck", "Relay", "RelayState"]

log = get_logger(__name__)


class RelayState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


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
        self.owner = owner or owner_id()
        self.state = RelayState.CREATED
        self._ports = RelayPorts(leases, source, sink, wakeups)
        self._after_ack = after_ack
        self._stopping = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        # Test-only seam: the monotonic clock leases are timed with (None: the loop's).
        self._clock = clock or _loop_time
        self._drivers: dict[int, asyncio.Task[None]] = {}
        # partition -> epoch of the lease its current driver holds.
        self._driving: dict[int, int] = {}
        self._rounds = 0
        self._retention: asyncio.Task[None] | None = None
        self._gauges = Gauges(settings, self.owner, self._ports, self._clock)
        self._backoff = settings.backoff()
        self._started = False
        self._next_retention = self._next_gauges = 0.0
        self._driver_failures = 0
        self._drivers_paused_until = 0.0
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
        await self._ports.sink.stop()
        await self._ports.wakeups.close()
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
        tick = min(s.relay_lease_seconds / 3, s.relay_poll_interval_seconds)
        failures = 0
        now = self._clock()
        self._next_retention = now + min(s.relay_retention_interval_seconds, 5.0)
        self._next_gauges = now
        while not self._stopping.is_set():
            try:
                await self._supervision_round()
                failures = 0
                delay = tick
            except Exception as error:
                if not self._may_retry(error):
                    break
                failures += 1
                delay = self._backoff.delay(failures)
            await sleep_unless(self._stopping, delay)
        # Drivers notice `_stopping` themselves and release their leases.

    async def _supervision_round(self) -> None:
        if not self._started:
            await self._ports.leases.ensure_partitions(self.settings.relay_partitions)
            tiers = set(self.settings.relay_topic_tiers) | set(
                await self._ports.source.known_tiers()
            )
            await self._ports.sink.start(sorted(tiers))
            self._started = True
        await self._ports.wakeups.ensure()
        await self._take_free_partitions(self._partitions_wanted())
        now = self._clock()
        if now >= self._next_retention:
            self._next_retention = now + self.settings.relay_retention_interval_seconds
            self._start_retention()
        if now >= self._next_gauges:
            self._next_gauges = now + self.settings.relay_metrics_interval_seconds
            await self._gauges.refresh()
        self._rounds += 1
        await self._announce_partitions()

    def _may_retry(self, error: Exception) -> bool:
        """Whether the supervisor goes on after ``error`` (an outage) or stops (a bug, a
        misconfiguration), setting ``failure`` so the process exits non-zero."""
        if not isinstance(error, KbError):
            log.exception("relay.crashed")
            self.failure = KbError(f"relay supervisor crashed: {error!r}")
            self._stopping.set()
            return False
        if not error.retriable and not self._started:
            # Misconfiguration (partition count): no point retrying; say so and stop.
            log.error("relay.cannot_start", error=str(error), code=error.code)
            self.failure = error
            self._stopping.set()
            return False
        log.warning("relay.supervisor_retry", error=str(error), code=error.code)
        return True

    def _partitions_wanted(self) -> int:
        """How many more partitions to ask for: up to the cap, none for a while after a
        driver died of a non-retriable error (a bug, a broken row) so as not to spin on it."""
        s = self.settings
        cap = s.relay_max_partitions_per_instance or s.relay_partitions
        if self._reap_drivers():
            self._driver_failures += 1
            self._drivers_paused_until = self._clock() + self._backoff.delay(self._driver_failures)
            return 0
        if self._clock() < self._drivers_paused_until:
            return 0
        return cap - len(self._drivers)

    async def _take_free_partitions(self, wanted: int) -> None:
        if wanted <= 0:
            return
        asked = self._clock()  # the lease runs from before the request, to be safe
        for lease in await self._ports.leases.acquire(
            self.owner, wanted, self.settings.relay_lease_seconds
        ):
            metrics.LEASE_CHANGES.labels(change="acquired").inc()
            log.info(
                "lease.acquired", owner=self.owner, partition=lease.partition, epoch=lease.epoch
            )
            # Our old driver of this partition may still run (stuck past its lease): it is
            # cancelled, and the new one waits for it to end.
            previous = self._drivers.get(lease.partition)
            if previous is not None:
                previous.cancel()
            self._driving[lease.partition] = lease.epoch
            self._drivers[lease.partition] = asyncio.create_task(
                self._drive(lease, acquired_at=asked, after=previous),
                name=f"relay-partition-{lease.partition}",
            )
        await self._announce_partitions()

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

    def _start_retention(self) -> None:
        """Any instance may run retention; the store lets one at a time delete."""
        if self._retention is None or self._retention.done():
            self._retention = asyncio.create_task(self._run_retention(), name="relay-retention")

    async def _run_retention(self) -> None:
        s = self.settings
        try:
            deleted = await self._ports.source.delete_delivered(
                s.relay_retention_seconds, s.relay_retention_batch
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
        driver = PartitionDriver(
            self.settings,
            lease,
            self._ports,
            acquired_at=acquired_at,
            stopping=self._stopping,
            clock=self._clock,
            after_ack=self._after_ack,
        )
        step: Step | None = None
        try:
            step = await driver.drive()
        finally:
            # Only our own entry: the partition may be driven by a newer lease already.
            if self._driving.get(lease.partition) == lease.epoch:
                del self._driving[lease.partition]
            await self._announce_partitions()
            await driver.finish(step)
