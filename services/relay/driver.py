"""One leased partition driven by one task: read a batch, send it, record progress.

A driver repeats: read the next batch of its partition's current snapshot window (see
``outbox_pg.py`` for why windows never skip a row), send it, wait for Kafka's
acknowledgement, and only then record progress with a write fenced on the lease's owner
and epoch. Kafka or PostgreSQL being down means: back off, keep renewing the lease, retry
the same batch; nothing is lost and nothing crashes. A driver stops as soon as its lease
is lost, by its own clock (which runs out before the database's) or because a fenced
write touched no row.

A send never outlasts the lease: a driver starts one only when it ends (the sink's
``relay_send_timeout_seconds``, failure and producer close included) before the lease
time it trusts, renewing first when the time left is too short, and it gives a send up
(and stops driving) should one still run past that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable, Sequence

from services.relay import metrics
from services.relay.ports import (
    ClusterChanged,
    Lease,
    OutboxRecord,
    RelayPorts,
    WakeupSubscription,
)
from services.relay.settings import LOCAL_LEASE_SHARE, RelaySettings
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)

# Test-only seam: awaited after Kafka acknowledged a batch and before its progress is
# recorded (None in production). Tests use it to observe or to crash at that point.
AfterAck = Callable[[Lease, Sequence[OutboxRecord]], Awaitable[None]]


class Step(enum.Enum):
    """What one round of a driver came to."""

    MORE = "more"  # the window has more rows: read on at once
    DRAINED = "drained"  # wait for new rows (or the poll timer)
    RETRY_LATER = "retry_later"  # a renewal took too long to start a send: back off
    LOST = "lost"  # the lease is gone: stop driving, write nothing
    REFUSED = "refused"  # progress from another cluster: never drive on it


async def sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake at once when ``stopping`` is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stopping.wait()


class PartitionDriver:
    def __init__(
        self,
        settings: RelaySettings,
        lease: Lease,
        ports: RelayPorts,
        *,
        acquired_at: float,
        stopping: asyncio.Event,
        clock: Callable[[], float],
        after_ack: AfterAck | None = None,
    ) -> None:
        self._settings = settings
        self._lease = lease
        self._ports = ports
        self._stopping = stopping
        self._clock = clock
        self._after_ack = after_ack
        self._backoff = settings.backoff()
        self._failures = 0
        self._trusted_share = settings.relay_lease_seconds * LOCAL_LEASE_SHARE
        self._renew_every = settings.relay_lease_seconds / 3
        self._trusted_until = acquired_at + self._trusted_share
        self._last_renewed = self._last_saved = acquired_at
        self._unsaved = False
        self.progress = lease.progress

    async def drive(self) -> Step | None:
        """Drive until stopped (None) or the lease is lost or refused; then ``finish``."""
        subscription = self._ports.wakeups.subscribe()
        armed = False
        try:
            while not self._stopping.is_set():
                if self._clock() >= self._trusted_until:
                    return Step.LOST
                subscription.clear()
                step = await self._round()
                if step in (Step.LOST, Step.REFUSED):
                    return step
                if step is Step.DRAINED and not armed:
                    # Writers notify only while a relay waits (the doorbell): arm it, then
                    # read once more, since a row committed before that rang no bell.
                    await self._ports.wakeups.arm()
                    armed = True
                    continue
                armed = False
                if step is Step.RETRY_LATER:
                    await self._back_off()
                elif step is Step.DRAINED:
                    await self._wait_for_rows(subscription)
            return None
        finally:
            self._ports.wakeups.unsubscribe(subscription)

    async def finish(self, step: Step | None) -> None:
        """Hand the partition back with the progress reached (a lost lease: nothing)."""
        lease = self._lease
        if step in (Step.LOST, Step.REFUSED):
            metrics.LEASE_CHANGES.labels(change="lost").inc()
            log.warning(
                "lease.lost", owner=lease.owner, partition=lease.partition, epoch=lease.epoch
            )
            return
        with contextlib.suppress(KbError):
            await self._ports.leases.release(lease, self.progress)
        metrics.LEASE_CHANGES.labels(change="released").inc()
        log.info("lease.released", owner=lease.owner, partition=lease.partition, epoch=lease.epoch)

    async def _round(self) -> Step:
        """One batch, with the errors a batch may meet turned into a step."""
        try:
            step = await self._relay_one_batch()
        except ClusterChanged as error:
            log.error(
                "relay.cluster_changed",
                owner=self._lease.owner,
                partition=self._lease.partition,
                epoch=self._lease.epoch,
                error=error.message,
            )
            return Step.REFUSED
        except KbError as error:
            if not error.retriable:
                raise
            return await self._after_retriable_failure(error)
        if step in (Step.MORE, Step.DRAINED):
            self._failures = 0
        return step

    async def _relay_one_batch(self) -> Step:
        s = self._settings
        batch = await self._ports.source.read_window_batch(
            self._lease, self.progress, s.relay_batch_size
        )
        if batch.records:
            blocked = await self._deliver(batch.records)
            if blocked is not None:
                return blocked
        self.progress = batch.following
        self._unsaved = self._unsaved or bool(batch.records)
        if not await self._save_progress_when_due():
            return Step.LOST
        return Step.DRAINED if batch.following.window is None else Step.MORE

    async def _deliver(self, records: Sequence[OutboxRecord]) -> Step | None:
        """Send ``records`` within the trusted lease time; None once Kafka acknowledged."""
        blocked = await self._make_time_for_a_send()
        if blocked is not None:
            return blocked
        if not await self._send_within(records, self._trusted_until - self._clock()):
            log.error(
                "relay.send_outlived_lease",
                owner=self._lease.owner,
                partition=self._lease.partition,
                epoch=self._lease.epoch,
            )
            return Step.LOST
        if self._after_ack is not None:
            await self._after_ack(self._lease, records)
        return None

    async def _make_time_for_a_send(self) -> Step | None:
        """A send may only start when it ends (relay_send_timeout_seconds, its failure
        included) before the lease time we trust: past it another relay may drive this
        partition. Renew first when that is too close."""
        timeout = self._settings.relay_send_timeout_seconds
        if self._clock() + timeout < self._trusted_until:
            return None
        if not await self._renew():
            return Step.LOST
        if self._clock() + timeout >= self._trusted_until:
            return Step.RETRY_LATER  # the renewal itself took too long
        return None

    async def _save_progress_when_due(self) -> bool:
        """Progress is written only for acknowledged batches, at most every
        relay_progress_interval_seconds (a crash re-sends at most that much: at least
        once), and at every lease renewal, which it doubles as. False: lease lost."""
        now = self._clock()
        save_due = self._unsaved and now - self._last_saved >= (
            self._settings.relay_progress_interval_seconds
        )
        if not (save_due or now - self._last_renewed >= self._renew_every):
            return True
        if not await self._ports.leases.commit_progress(
            self._lease, self.progress, self._settings.relay_lease_seconds
        ):
            return False
        self._last_renewed = self._last_saved = now
        self._trusted_until = now + self._trusted_share
        self._unsaved = False
        return True

    async def _renew(self) -> bool:
        asked = self._clock()  # the lease runs from before the request, to be safe
        if not await self._ports.leases.renew(self._lease, self._settings.relay_lease_seconds):
            return False
        self._last_renewed = asked
        self._trusted_until = asked + self._trusted_share
        return True

    async def _after_retriable_failure(self, error: KbError) -> Step:
        """Keep the lease while the outage lasts; the same batch is tried again later."""
        log.warning(
            "relay.batch_retry",
            partition=self._lease.partition,
            error=str(error),
            code=error.code,
        )
        if self._clock() - self._last_renewed >= self._renew_every:
            with contextlib.suppress(KbError):
                if not await self._renew():
                    return Step.LOST
        return Step.RETRY_LATER

    async def _back_off(self) -> None:
        """Wait longer after each failure in a row, never past the trusted lease time."""
        self._failures += 1
        delay = self._backoff.delay(self._failures)
        await sleep_unless(
            self._stopping, min(delay, max(0.0, self._trusted_until - self._clock()))
        )

    async def _send_within(self, records: Sequence[OutboxRecord], within_s: float) -> bool:
        """Send, giving the send up when it runs past ``within_s`` (False): the sink keeps
        to relay_send_timeout_seconds, this only guards against one that does not."""
        try:
            async with asyncio.timeout(within_s) as deadline:
                await self._ports.sink.send(records, replay=False)
        except TimeoutError:
            if deadline.expired():
                return False
            raise
        return True

    async def _wait_for_rows(self, subscription: WakeupSubscription) -> None:
        """Until a notification, the poll timer, the next renewal or save, or stop."""
        s = self._settings
        now = self._clock()
        wait = min(s.relay_poll_interval_seconds, self._renew_every - (now - self._last_renewed))
        if self._unsaved:
            wait = min(wait, s.relay_progress_interval_seconds - (now - self._last_saved))
        rang = asyncio.create_task(subscription.wait(max(0.0, wait)))
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({rang, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (rang, stopping):
                task.cancel()
            await asyncio.gather(rang, stopping, return_exceptions=True)
