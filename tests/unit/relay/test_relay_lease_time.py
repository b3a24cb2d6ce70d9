"""A send never outlasts the lease a driver trusts, and a partition taken again while its
old driver still runs keeps one driver and consistent bookkeeping."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from services.relay.ports import Lease, OutboxRecord, Progress, WindowBatch
from services.relay.relay import Relay
from services.relay.settings import LOCAL_LEASE_SHARE
from tests.fakes.relay import FakeLeaseStore, FakeWakeups, FlakySink, LogSource
from tests.unit.relay.test_relay_loop import Harness

LEASE_S = 1.0
SEND_TIMEOUT_S = 0.5


class FakeClock:
    """A monotonic clock that moves only when told (reads "take time")."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Journal:
    """What the relay asked for, in order, with the fake clock's time of asking."""

    def __init__(self, clock: FakeClock, leases: FakeLeaseStore, sink: FlakySink) -> None:
        self.entries: list[tuple[str, float]] = []
        self.changed = asyncio.Event()
        acquire, renew, commit, send = (
            leases.acquire,
            leases.renew,
            leases.commit_progress,
            sink.send,
        )

        async def acquiring(owner: str, limit: int, lease_s: float) -> list[Lease]:
            asked = clock()
            taken = await acquire(owner, limit, lease_s)
            if taken:
                self.entries.append(("lease", asked))
            self.changed.set()
            return taken

        async def renewing(lease: Lease, lease_s: float) -> bool:
            asked = clock()
            renewed = await renew(lease, lease_s)
            self.entries.append(("lease" if renewed else "lost", asked))
            self.changed.set()
            return renewed

        async def committing(lease: Lease, progress: Progress, lease_s: float) -> bool:
            asked = clock()
            done = await commit(lease, progress, lease_s)
            self.entries.append(("lease" if done else "lost", asked))
            self.changed.set()
            return done

        async def sending(records: Sequence[OutboxRecord], *, replay: bool) -> None:
            self.entries.append(("send", clock()))
            self.changed.set()
            await send(records, replay=replay)

        leases.acquire = acquiring  # type: ignore[method-assign,assignment]
        leases.renew = renewing  # type: ignore[method-assign,assignment]
        leases.commit_progress = committing  # type: ignore[method-assign,assignment]
        sink.send = sending  # type: ignore[method-assign]

    def sends_fit_in_the_trusted_lease(self) -> bool:
        trusted_until = float("-inf")
        for kind, at in self.entries:
            if kind == "lease":
                trusted_until = at + LEASE_S * LOCAL_LEASE_SHARE
            elif kind == "send" and not at + SEND_TIMEOUT_S < trusted_until:
                return False
        return True


def _harness(sink: FlakySink, **overrides: object) -> Harness:
    values: dict[str, object] = {
        "relay_partitions": 1,
        "relay_lease_seconds": LEASE_S,
        "relay_send_timeout_seconds": SEND_TIMEOUT_S,
    }
    values.update(overrides)
    return Harness(sink, **values)


def _slow_first_read(harness: Harness, clock: FakeClock, takes_s: float, then: object) -> None:
    """The first read takes ``takes_s`` of the lease (by the fake clock), then ``then()``."""
    read = harness.source.read_window_batch
    first = True

    async def slow(lease: Lease, progress: Progress, limit: int) -> WindowBatch:
        nonlocal first
        batch = await read(lease, progress, limit)
        if first:
            first = False
            clock.now += takes_s
            if callable(then):
                then()
        return batch

    harness.source.read_window_batch = slow  # type: ignore[method-assign]


async def test_a_send_too_close_to_the_lease_end_waits_for_a_renewal() -> None:
    clock = FakeClock()
    harness = _harness(FlakySink())
    journal = Journal(clock, harness.leases, harness.sink)
    rows = harness.source.append(2)
    # Reading took half the lease: a send started now could end past the trusted time.
    _slow_first_read(harness, clock, 0.5 * LEASE_S, then=None)
    relay = Relay(
        harness.settings,
        leases=harness.leases,
        source=harness.source,
        sink=harness.sink,
        wakeups=harness.wakeups,
        owner="relay-a",
        after_ack=harness._after_ack,
        clock=clock,
    )
    async with relay:
        positions = await harness.acked_positions(2)
    assert positions == [r.position for r in rows]
    kinds = [kind for kind, _ in journal.entries]
    assert kinds[:3] == ["lease", "lease", "send"]  # acquired, renewed, and only then sent
    assert journal.sends_fit_in_the_trusted_lease()


async def test_a_driver_that_cannot_renew_in_time_sends_nothing_and_lets_go() -> None:
    clock = FakeClock()
    harness = _harness(FlakySink())
    journal = Journal(clock, harness.leases, harness.sink)
    harness.source.append(2)
    # Reading took half the lease, and meanwhile another relay took the partition over.
    _slow_first_read(harness, clock, 0.5 * LEASE_S, then=lambda: harness.leases.steal(0, "relay-b"))
    relay = Relay(
        harness.settings,
        leases=harness.leases,
        source=harness.source,
        sink=harness.sink,
        wakeups=harness.wakeups,
        owner="relay-a",
        clock=clock,
    )
    async with relay:
        async with asyncio.timeout(10):
            while [kind for kind, _ in journal.entries] != ["lease", "lost"]:
                await journal.changed.wait()
                journal.changed.clear()
            await relay.wait_for_partitions(0)
    assert harness.sink.attempts == 0
    assert [kind for kind, _ in journal.entries] == ["lease", "lost"]


class BlockingSink(FlakySink):
    """Never acknowledges: a send that ignores its own timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.given_up = asyncio.Event()

    async def start(self, tiers: Iterable[str] = ()) -> None:
        return None

    async def send(self, records: Sequence[OutboxRecord], *, replay: bool) -> None:
        self.attempts += 1
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.given_up.set()
            raise


async def test_a_send_running_past_the_trusted_lease_is_given_up() -> None:
    sink = BlockingSink()
    harness = _harness(sink)
    harness.source.append(1)
    async with harness.relay() as relay:
        async with asyncio.timeout(10):
            await sink.started.wait()
            # The driver gives the send up when its trusted lease time is over...
            await sink.given_up.wait()
            # ...and stops driving the partition (until it takes the lease again).
            await relay.wait_for_partitions(0)
    assert not sink.sent


async def test_a_partition_taken_again_while_its_old_driver_is_stuck_has_one_driver() -> None:
    harness = Harness(
        FlakySink(), relay_lease_seconds=LEASE_S, relay_send_timeout_seconds=SEND_TIMEOUT_S
    )
    harness.source.append(4)  # positions 1, 3 in partition 1; 2, 4 in partition 0
    read = harness.source.read_window_batch
    stuck = asyncio.Event()
    old_driver_cancelled = asyncio.Event()

    async def reading(lease: Lease, progress: Progress, limit: int) -> WindowBatch:
        if lease.partition == 0 and lease.epoch == 1:
            stuck.set()
            try:
                await asyncio.Event().wait()  # a read that hangs (a stuck connection)
            except asyncio.CancelledError:
                old_driver_cancelled.set()
                raise
        return await read(lease, progress, limit)

    harness.source.read_window_batch = reading  # type: ignore[method-assign]
    async with harness.relay() as relay:
        async with asyncio.timeout(10):
            await relay.wait_for_partitions(2)
            await stuck.wait()
            # Partition 0's lease runs out in the database while its driver hangs, and
            # partition 1 goes to another relay: the supervisor has room and takes 0 again.
            harness.leases.rows[0].lease_until = None
            harness.leases.rows[0].owner = None
            harness.leases.steal(1, "relay-b")
            while True:
                lease, records = await harness.acked.get()
                if lease.partition == 0:
                    break
            await old_driver_cancelled.wait()
        assert lease.epoch == 2
        assert [r.position for r in records] == [2, 4]
        # The old driver ended before the new one sent, and its exit did not take the
        # new driver's partition off the books.
        assert relay.partitions == {0}
    assert harness.leases.rows[0].epoch == 2


_ = LogSource, FakeWakeups
