"""The relay loop's own rules, on in-memory ports: retry without loss, progress only after
acknowledgement, stop driving a partition whose lease is gone, split work by cap."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime

import pytest

from services.relay.ports import Lease, OutboxRecord, Progress, ReplayFilter
from services.relay.relay import Relay
from services.relay.replay import ReplayInterrupted, replay
from services.relay.settings import RelaySettings
from services.runtime.backoff import Backoff
from tests.fakes.relay import (
    INITIAL_SNAPSHOT,
    FakeLeaseStore,
    FakeWakeups,
    FlakySink,
    LogSource,
)


def _settings(**overrides: object) -> RelaySettings:
    values: dict[str, object] = {
        "relay_partitions": 2,
        "relay_lease_seconds": 3.0,
        "relay_send_timeout_seconds": 1.0,
        "relay_poll_interval_seconds": 0.05,
        "relay_backoff_initial_seconds": 0.001,
        "relay_backoff_max_seconds": 0.01,
        "relay_progress_interval_seconds": 0.0,
        "relay_batch_size": 3,
    }
    values.update(overrides)
    return RelaySettings.model_validate(values)


class Harness:
    def __init__(self, sink: FlakySink, **overrides: object) -> None:
        self.leases = FakeLeaseStore()
        self.source = LogSource()
        self.sink = sink
        self.wakeups = FakeWakeups()
        self.acked: asyncio.Queue[tuple[Lease, list[OutboxRecord]]] = asyncio.Queue()
        self.settings = _settings(**overrides)

    async def _after_ack(self, lease: Lease, records: Sequence[OutboxRecord]) -> None:
        await self.acked.put((lease, list(records)))

    def relay(self, owner: str = "relay-a") -> Relay:
        return Relay(
            self.settings,
            leases=self.leases,
            source=self.source,
            sink=self.sink,
            wakeups=self.wakeups,
            owner=owner,
            after_ack=self._after_ack,
        )

    async def acked_positions(self, count: int) -> list[int]:
        positions: list[int] = []
        async with asyncio.timeout(10):
            while len(positions) < count:
                _, records = await self.acked.get()
                positions.extend(r.position for r in records)
        return positions


def _covered(partition: int, progress: Progress) -> set[int]:
    """Positions of ``partition`` a progress record claims are delivered (LogSource model:
    a snapshot is the highest visible position)."""
    if progress.window is not None:
        upto = progress.window_position
    else:
        upto = 0 if progress.delivered == INITIAL_SNAPSHOT else int(progress.delivered)
    return {p for p in range(1, upto + 1) if p % 2 == partition}


async def test_failed_sends_are_retried_and_progress_waits_for_the_ack() -> None:
    harness = Harness(FlakySink(failures=4))
    claims: list[tuple[set[int], set[int]]] = []
    commit = harness.leases.commit_progress

    async def observed(
        lease: Lease, progress: Progress, lease_s: float, now: datetime | None = None
    ) -> bool:
        acked = {r.position for r, _ in harness.sink.sent}
        claims.append((_covered(lease.partition, progress), acked))
        return await commit(lease, progress, lease_s, now)

    harness.leases.commit_progress = observed  # type: ignore[method-assign]
    rows = harness.source.append(10)
    async with harness.relay() as relay:
        await relay.wait_for_partitions(2)
        positions = await harness.acked_positions(10)
    assert sorted(positions) == [r.position for r in rows]
    assert harness.sink.attempts >= 4 + 4  # four failures, then at least one per batch
    # Every progress write claimed only positions Kafka had acknowledged by then.
    assert claims
    for covered, acked in claims:
        assert covered <= acked


async def test_per_partition_order_is_position_order() -> None:
    harness = Harness(FlakySink())
    harness.source.append(20)
    async with harness.relay() as relay:
        await relay.wait_for_partitions(2)
        await harness.acked_positions(20)
    for partition in (0, 1):
        sent = [r.position for r, _ in harness.sink.sent if r.position % 2 == partition]
        assert sent == sorted(sent)
        assert len(sent) == 10


async def test_new_rows_wake_the_relay() -> None:
    harness = Harness(FlakySink(), relay_poll_interval_seconds=30.0)
    async with harness.relay() as relay:
        await relay.wait_for_partitions(2)
        fresh = harness.source.append(4)
        harness.wakeups.ring()
        positions = await harness.acked_positions(4)
    assert sorted(positions) == [r.position for r in fresh]


async def test_a_relay_whose_lease_was_taken_stops_driving_that_partition() -> None:
    harness = Harness(FlakySink())
    async with harness.relay() as relay:
        await relay.wait_for_partitions(2)
        harness.leases.steal(0, "relay-b")
        # Its next fenced write touches nothing: it lets go of partition 0.
        await relay.wait_for_partitions(1)
        assert relay.partitions == {1}
        sent_before = len(harness.sink.sent)
        harness.source.append(6)
        harness.wakeups.ring()
        await harness.acked_positions(3)
        assert {r.position % 2 for r, _ in harness.sink.sent[sent_before:]} == {1}
    assert harness.leases.rows[0].owner == "relay-b"


async def test_the_cap_splits_partitions_between_instances() -> None:
    harness = Harness(FlakySink(), relay_max_partitions_per_instance=1)
    first, second = harness.relay("relay-a"), harness.relay("relay-b")
    async with first, second:
        await first.wait_for_partitions(1)
        await second.wait_for_partitions(1)
        assert first.partitions.isdisjoint(second.partitions)


async def test_a_wrong_partition_count_stops_the_relay_with_a_config_error() -> None:
    harness = Harness(FlakySink())
    await harness.leases.ensure_partitions(3)
    relay = harness.relay()
    async with relay:
        async with asyncio.timeout(5):
            await relay.wait_stopped()
    assert relay.failure is not None
    assert relay.failure.code == "CONFIG_INVALID"


async def test_replay_paces_marks_and_resumes_hint() -> None:
    source = LogSource()
    source.append(12)
    sink = FlakySink()
    where = ReplayFilter(after_position=3, up_to_position=9)
    result = await replay(source, sink, where, batch_size=4)
    assert result.sent == 6
    assert [r.position for r, flag in sink.sent] == [4, 5, 6, 7, 8, 9]
    assert all(flag for _, flag in sink.sent)

    down = FlakySink(failures=100)
    with pytest.raises(ReplayInterrupted) as raised:
        await replay(
            source,
            down,
            ReplayFilter(after_position=3),
            max_attempts=2,
            backoff=Backoff(0.001, 0.001),
        )
    assert "--from 4" in raised.value.message


async def test_a_row_committed_while_the_doorbell_is_armed_is_read_before_waiting() -> None:
    # No notification ever rings, and the poll timer and the next renewal are far away:
    # the row written just as the relay arms the doorbell is only found by the read that
    # follows the arming.
    harness = Harness(
        FlakySink(),
        relay_poll_interval_seconds=60.0,
        relay_lease_seconds=300.0,
        relay_partitions=1,
    )
    appended: list[int] = []

    def write_once() -> None:
        if not appended:
            appended.extend(r.position for r in harness.source.append(1))

    harness.wakeups.on_arm = write_once
    async with harness.relay() as relay:
        await relay.wait_for_partitions(1)
        positions = await harness.acked_positions(1)
    assert positions == appended
    assert harness.wakeups.armed >= 1
