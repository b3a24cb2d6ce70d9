"""The supervisor's jobs besides leases: retention runs on any instance, and a capped set
of instances too small for the partitions is reported."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from tests.fakes.relay import FlakySink
from tests.unit.relay.test_relay_loop import Harness


def _gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None
    return value


async def test_retention_runs_on_an_instance_that_does_not_hold_partition_0() -> None:
    harness = Harness(
        FlakySink(),
        relay_max_partitions_per_instance=1,
        relay_retention_interval_seconds=0.01,
    )
    await harness.leases.ensure_partitions(2)
    harness.leases.steal(0, "relay-elsewhere")
    asked = asyncio.Event()

    async def delete_delivered(older_than_s: float, batch: int) -> int:
        asked.set()
        return 0

    harness.source.delete_delivered = delete_delivered  # type: ignore[method-assign]
    async with harness.relay() as relay:
        await relay.wait_for_partitions(1)
        assert relay.partitions == {1}
        async with asyncio.timeout(10):
            await asked.wait()


async def test_too_few_capped_instances_for_the_partitions_are_reported() -> None:
    harness = Harness(
        FlakySink(),
        relay_partitions=4,
        relay_max_partitions_per_instance=1,
        relay_metrics_interval_seconds=0.01,
    )
    first = harness.relay("relay-a")
    async with first:
        await first.wait_for_partitions(1)
        await first.wait_for_rounds(first.rounds + 2)
        assert _gauge("kb_relay_uncoverable_partitions") == 3
        assert _gauge("kb_relay_live_instances") == 1
        second = harness.relay("relay-b")
        async with second:
            await second.wait_for_partitions(1)
            await second.wait_for_rounds(second.rounds + 2)
            assert _gauge("kb_relay_uncoverable_partitions") == 2
            assert _gauge("kb_relay_live_instances") == 2


async def test_without_a_cap_nothing_is_uncoverable() -> None:
    harness = Harness(FlakySink(), relay_partitions=4, relay_metrics_interval_seconds=0.01)
    relay = harness.relay()
    async with relay:
        await relay.wait_for_partitions(4)
        await relay.wait_for_rounds(relay.rounds + 2)
        assert _gauge("kb_relay_uncoverable_partitions") == 0
