"""The hint consumer: valid hints wake the worker once per batch, bad input is skipped and
counted, an outage is survived and reported."""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from services.indexer.queue.hints import HintConsumer, HintMessage, HintStats, SkipReason
from services.runtime.messaging.avro import MAGIC, default_registry
from services.runtime.messaging.events import DOCUMENT_SEARCH_VERSION_SWITCHED, INDEX_TASK_CREATED

REGISTRY = default_registry()


def hint(tier: str = "standard") -> HintMessage:
    payload = REGISTRY.encode(
        INDEX_TASK_CREATED,
        {
            "eventId": uuid.uuid4(),
            "tenantId": "acme",
            "tier": tier,
            "documentId": uuid.uuid4(),
            "versionNumber": 1,
            "taskId": uuid.uuid4(),
            "taskType": "INDEX_VERSION",
            "occurredAt": datetime.now(UTC),
        },
    )
    return HintMessage(payload, {"event_type": INDEX_TASK_CREATED.encode()})


def switched() -> HintMessage:
    payload = REGISTRY.encode(
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        {
            "eventId": uuid.uuid4(),
            "tenantId": "acme",
            "tier": "standard",
            "documentId": uuid.uuid4(),
            "versionNumber": 2,
            "previousVersionNumber": 1,
            "embeddingModel": "m",
            "chunkCount": 3,
            "taskId": uuid.uuid4(),
            "occurredAt": datetime.now(UTC),
        },
    )
    return HintMessage(payload, {})


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def consumer(wake: Wakes, **kwargs: Any) -> HintConsumer:
    async def no_connect() -> Any:
        raise AssertionError("not used")

    return HintConsumer(tier="standard", wake=wake, connect=no_connect, **kwargs)


def test_a_batch_of_hints_wakes_once_and_counts_the_rest_as_coalesced() -> None:
    wakes = Wakes()
    hints = consumer(wakes)
    assert hints.handle([hint() for _ in range(10_000)])
    assert wakes.count == 1
    assert hints.stats.received == 10_000
    assert hints.stats.woke == 1
    assert hints.stats.coalesced == 9_999


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (HintMessage(os.urandom(64), {}), SkipReason.UNDECODABLE),
        (HintMessage(None, {}), SkipReason.UNDECODABLE),
        (HintMessage(MAGIC + b"\x00" * 8 + b"body", {}), SkipReason.UNKNOWN_FINGERPRINT),
        (HintMessage(b"x" * (1024 * 1024), {}), SkipReason.TOO_LARGE),
        (switched(), SkipReason.UNKNOWN_EVENT_TYPE),
        (HintMessage(hint().value, {"event_type": b"Surprise"}), SkipReason.UNKNOWN_EVENT_TYPE),
        (hint(tier="premium"), SkipReason.OTHER_TIER),
    ],
)
def test_bad_input_is_skipped_counted_and_wakes_nothing(message: HintMessage, reason: str) -> None:
    wakes = Wakes()
    hints = consumer(wakes)
    assert not hints.handle([message, message])
    assert wakes.count == 0
    assert hints.stats.skipped == {reason: 2}


def test_garbage_beside_a_hint_still_wakes() -> None:
    wakes = Wakes()
    hints = consumer(wakes)
    assert hints.handle([HintMessage(os.urandom(10), {}), hint(), hint(tier="other")])
    assert wakes.count == 1
    assert hints.stats.skipped == {SkipReason.UNDECODABLE: 1, SkipReason.OTHER_TIER: 1}


class FlakySource:
    """Fails to connect ``failures`` times, then serves ``batches`` and records commits."""

    def __init__(self, batches: list[list[HintMessage]]) -> None:
        self.batches = batches
        self.commits = 0
        self.closed = 0

    async def read(self, timeout_seconds: float) -> list[HintMessage]:
        if self.batches:
            return self.batches.pop(0)
        raise ConnectionError("broker went away")

    async def commit(self) -> None:
        self.commits += 1

    async def close(self) -> None:
        self.closed += 1
        # As aiokafka's stop() does with the broker gone: its fetch task's cancellation.
        raise asyncio.CancelledError


async def test_an_outage_is_survived_reported_and_hints_resume() -> None:
    wakes = Wakes()
    stop = asyncio.Event()
    connects = 0
    states: list[bool] = []
    second = FlakySource([[hint()], [hint(), hint()]])
    resumed = asyncio.Event()

    async def connect() -> FlakySource:
        nonlocal connects
        connects += 1
        if connects == 1:
            raise ConnectionError("no broker at start")
        if connects == 2:
            return FlakySource([[hint()]])  # one batch, then the broker goes away
        if connects == 3:
            resumed.set()
            return second
        stop.set()
        raise ConnectionError("down again")

    def on_change(stats: HintStats) -> None:
        states.append(stats.connected)

    hints = HintConsumer(
        tier="standard",
        wake=wakes,
        connect=connect,
        reconnect_min_seconds=0.001,
        reconnect_max_seconds=0.002,
        on_change=on_change,
    )
    async with asyncio.timeout(10):
        await hints.run(stop)
    assert resumed.is_set()
    assert wakes.count == 3  # one per batch: [1], [1], [2]
    assert second.commits == 2  # offsets committed after each wake
    assert second.closed == 1
    assert hints.stats.connected is False
    assert hints.stats.outages == 3  # at start, after the first source, after the second
    assert states.count(True) >= 1  # it was connected at some point
    assert states[-1] is False


async def test_stopping_does_not_wait_for_a_slow_join() -> None:
    # A group join waits for the rebalance (a killed member until its session expires): a
    # stopping worker cancels it rather than sitting out its bound.
    stop = asyncio.Event()
    joining = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow_join() -> Any:
        joining.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()  # where the real connect stops the consumer it started
            raise

    hints = HintConsumer(tier="standard", wake=Wakes(), connect=slow_join)
    running = asyncio.ensure_future(hints.run(stop))
    await joining.wait()
    stop.set()
    async with asyncio.timeout(5):
        await running
    assert cancelled.is_set()
    assert hints.stats.connected is False
    assert hints.stats.outages == 0  # stopping is not an outage
