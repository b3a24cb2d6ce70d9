"""The ingest loop's shutdown on a lane's failure (services/publisher/ingest/pipeline.py),
with a consumer and a processor of the test's own: the other lanes finish their step and
what is done is committed before the failure ends the process."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry, generate_latest

from services.publisher.ingest.commands import decode_command
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.pipeline import IngestLoop, IngestPace
from services.publisher.ingest.ports import CommandAnswer, IngestRecord
from services.publisher.ingest.process import Handled, Refusal, Verified
from services.runtime.backoff import Backoff
from tests.support.ingest import publish_command

TP = TopicPartition("kb.ingest.standard", 0)


class Consumer:
    """The batches given, then nothing; the commits it was asked for."""

    def __init__(self, *batches: list[Any]) -> None:
        self._batches = [{TP: messages} for messages in reversed(batches)]
        self.commits: list[dict[TopicPartition, int]] = []

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, Any]:
        if self._batches:
            return self._batches.pop()
        await asyncio.sleep(timeout_ms / 1000)
        return {}

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))

    def highwater(self, tp: TopicPartition) -> int | None:
        return None

    async def position(self, tp: TopicPartition) -> int:
        return 0


class Processor:
    """Tenant "good" applies once "bad" has failed (a bug, not a retriable error)."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.applied: list[int] = []

    async def sort(self, records: Sequence[IngestRecord]) -> tuple[list[Verified], list[Refusal]]:
        return [
            Verified(r, decode_command(r.value or b"", max_inline_bytes=1 << 20)) for r in records
        ], []

    async def apply(self, run: Sequence[Verified]) -> list[Handled]:
        if run[0].command.tenant_id == "bad":
            self.failed.set()
            raise RuntimeError("a bug in the apply")
        await self.failed.wait()
        # Still at work when the loop sees the failure (whatever the timing, the loop must
        # wait for it: a later end only makes a regression easier to see).
        await asyncio.sleep(0.05)
        self.applied.extend(item.record.offset for item in run)
        return [
            Handled(CommandAnswer(v.command.command_id, v.command.command_type, uuid.uuid4()))
            for v in run
        ]

    async def dead_letter(self, refusal: Refusal) -> None:
        raise AssertionError("nothing is refused here")


def _message(offset: int, tenant: str) -> Any:
    return SimpleNamespace(
        topic=TP.topic,
        partition=TP.partition,
        offset=offset,
        key=b"k",
        value=publish_command(tenant, f"page-{offset}"),
        headers=[],
        timestamp=None,
    )


async def test_a_lanes_failure_lets_the_others_finish_and_commits_what_is_done() -> None:
    consumer = Consumer([_message(0, "good"), _message(1, "good"), _message(2, "bad")])
    processor = Processor()
    loop = IngestLoop(
        consumer,
        processor,
        tier="standard",
        metrics=IngestMetrics(CollectorRegistry()),
        backoff=Backoff(0.01, 0.01),
        pace=IngestPace(batch_size=10, poll_timeout_seconds=0.01),
    )
    with pytest.raises(RuntimeError, match="a bug in the apply"):
        await asyncio.wait_for(loop.run(asyncio.Event()), 30)
    assert processor.applied == [0, 1]
    assert consumer.commits[-1] == {TP: 2}  # the done prefix; the failed record is read again


class Applied:
    """Applies every run at once."""

    async def sort(self, records: Sequence[IngestRecord]) -> tuple[list[Verified], list[Refusal]]:
        return await Processor().sort(records)

    async def apply(self, run: Sequence[Verified]) -> list[Handled]:
        return [
            Handled(CommandAnswer(v.command.command_id, v.command.command_type, uuid.uuid4()))
            for v in run
        ]

    async def dead_letter(self, refusal: Refusal) -> None:
        raise AssertionError("nothing is refused here")


async def test_a_tenants_lane_goes_once_it_is_idle_and_empty() -> None:
    # One lane per (partition, tenant) ever seen would grow with the tenants until a
    # rebalance; a lane is kept only while it has runs to apply.
    first = [_message(n, f"t{n}") for n in range(20)]
    again = [_message(20 + n, f"t{n}") for n in range(5)]  # tenants seen before, anew
    consumer = Consumer(first, again)
    held: list[tuple[int, int]] = []
    stop = asyncio.Event()

    async def before_commit(done: int) -> None:
        held.append((len(loop._lanes), len(loop._queues)))
        if done == 25:
            stop.set()

    loop = IngestLoop(
        consumer,
        Applied(),
        tier="standard",
        metrics=IngestMetrics(CollectorRegistry()),
        backoff=Backoff(0.01, 0.01),
        pace=IngestPace(batch_size=100, poll_timeout_seconds=0.01),
        before_commit=before_commit,
    )
    assert await asyncio.wait_for(loop.run(stop), 30) == 25
    assert consumer.commits[-1] == {TP: 25}
    assert held
    assert set(held) == {(0, 0)}


class Waiting:
    """Applies tenant "drained" at once; tenant "waiting" once ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def sort(self, records: Sequence[IngestRecord]) -> tuple[list[Verified], list[Refusal]]:
        return await Processor().sort(records)

    async def apply(self, run: Sequence[Verified]) -> list[Handled]:
        if run[0].command.tenant_id == "waiting":
            await self.release.wait()
        return await Applied().apply(run)

    async def dead_letter(self, refusal: Refusal) -> None:
        raise AssertionError("nothing is refused here")


class Watched(IngestMetrics):
    """Says when a tenant's backlog went back to none."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.drained: dict[str, asyncio.Event] = {}

    def held(self, tier: str, tenant: str, records: int) -> None:
        super().held(tier, tenant, records)
        if records < 0 and not self.backlog_of(tier, tenant):
            self.drained.setdefault(tenant, asyncio.Event()).set()


def _backlog_series(registry: CollectorRegistry) -> dict[str, float]:
    """kb_ingest_backlog's series in the exposition, by tenant."""
    series: dict[str, float] = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("kb_ingest_backlog{"):
            labels, value = line.rsplit(" ", 1)
            tenant = labels.split('tenant="', 1)[1].split('"', 1)[0]
            series[tenant] = float(value)
    return series


async def test_a_tenants_backlog_series_goes_once_its_backlog_drains() -> None:
    # A tenant label kept for ever once seen would grow with the tenants a process saw.
    registry = CollectorRegistry()
    metrics = Watched(registry)
    drained = metrics.drained["drained"] = asyncio.Event()
    processor = Waiting()
    messages = [_message(0, "waiting"), _message(1, "drained"), _message(2, "drained")]
    stop = asyncio.Event()
    loop = IngestLoop(
        Consumer(messages),
        processor,
        tier="standard",
        metrics=metrics,
        backoff=Backoff(0.01, 0.01),
        pace=IngestPace(batch_size=10, poll_timeout_seconds=0.01),
    )
    running = asyncio.create_task(loop.run(stop))
    await asyncio.wait_for(drained.wait(), 30)
    assert _backlog_series(registry) == {"waiting": 1.0}
    processor.release.set()
    await asyncio.wait_for(metrics.drained.setdefault("waiting", asyncio.Event()).wait(), 30)
    assert _backlog_series(registry) == {}
    stop.set()
    assert await asyncio.wait_for(running, 30) == 3
    assert _backlog_series(registry) == {}
