"""One contract for every ProviderStateStore: the PostgreSQL adapter and the in-memory one
must both pass it. Time is injected (ManualClock): pauses end and probes expire without
sleeping. Concurrent steps run on separate connections (PostgreSQL) and must come out as
if one ran after the other: that is the row locking at work."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.embedding.guard.breaker import BreakerPolicy, BreakerState
from services.embedding.guard.ports import ProviderStateStore, ProviderView
from services.embedding.guard.quota import (
    INDEXING_REQUESTS,
    REQUESTS,
    TOKENS,
    Bucket,
    Charge,
    Purpose,
    QuotaPlan,
    Reservation,
)
from services.embedding.guard.store_memory import InMemoryProviderStateStore
from services.embedding.guard.store_pg import PgProviderStateStore
from services.runtime.indexing.index_failures import ErrorCode
from tests.support.clock import ManualClock

POLICY = BreakerPolicy(failure_threshold=3, open_seconds=30, max_open_seconds=100, probe_seconds=60)
DOWN = ErrorCode.EMBEDDING_UNAVAILABLE
# Periods that are whole microseconds, as PostgreSQL stores them.
TEN_PER_SECOND = Bucket(REQUESTS, rate=10, burst=1)
TOKENS_BUCKET = Bucket(TOKENS, rate=1000, burst=100)


@dataclass
class Harness:
    store: ProviderStateStore
    clock: ManualClock
    provider: str

    def at(self, seconds: float) -> datetime:
        return self.clock.now() + timedelta(seconds=seconds)

    async def send_at(self, *charges: Charge, max_wait: float = 1e6, provider: str = "") -> float:
        """Seconds from now the reservation says to send at (granted)."""
        reservation = await self.store.reserve(
            provider or self.provider, list(charges), max_wait_seconds=max_wait
        )
        assert reservation.granted
        assert reservation.now == self.clock.now()
        return (reservation.send_at - self.clock.now()).total_seconds()

    async def fail(self, times: int = 1, *, probe_owner: str | None = None) -> None:
        for _ in range(times):
            await self.store.record_failure(
                self.provider, code=DOWN, probe_owner=probe_owner, policy=POLICY
            )


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def backend(request: pytest.FixtureRequest) -> Any:
    """None for the fake; the real pool (a fresh migrated database) for PostgreSQL. A sync
    fixture, so the session stack starts outside the event loop."""
    return None if request.param == "memory" else request.getfixturevalue("pool")


@pytest.fixture
def harness(backend: Any) -> Harness:
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0))
    store: ProviderStateStore = (
        InMemoryProviderStateStore(clock)
        if backend is None
        else PgProviderStateStore(backend, clock=clock)
    )
    return Harness(store, clock, f"openai:https://api.test/v1#m-{uuid.uuid4().hex[:6]}")


async def test_a_provider_never_seen_is_closed_and_unpaused(harness: Harness) -> None:
    view = await harness.store.view(harness.provider)
    assert view.provider == harness.provider
    assert view.now == harness.clock.now()
    assert view.state is BreakerState.CLOSED
    assert (view.consecutive_failures, view.paused_until, view.open_until) == (0, None, None)
    assert view.breaker.pristine


async def test_reservations_are_spaced_by_the_rate(harness: Harness) -> None:
    charge = Charge(TEN_PER_SECOND, 1)
    assert [await harness.send_at(charge) for _ in range(4)] == [0.0, 0.1, 0.2, 0.3]
    harness.clock.advance(10)  # idle: the bucket owes nothing
    assert await harness.send_at(charge) == 0.0


async def test_a_refused_reservation_leaves_no_debt(harness: Harness) -> None:
    charge = Charge(TEN_PER_SECOND, 1)
    for _ in range(5):
        await harness.send_at(charge)
    refused = await harness.store.reserve(harness.provider, [charge], max_wait_seconds=0.45)
    assert not refused.granted
    assert refused.wait_seconds == pytest.approx(0.5)
    assert await harness.send_at(charge) == 0.5


async def test_the_slowest_bucket_decides_and_every_bucket_owes(harness: Harness) -> None:
    heavy = [Charge(TEN_PER_SECOND, 1), Charge(TOKENS_BUCKET, 500)]
    assert await harness.send_at(*heavy) == 0.0
    # 500 tokens at 1000/s (burst 500 for this request): the tokens bucket says 0.5 s.
    assert await harness.send_at(*heavy) == 0.5
    # The requests bucket owes from the send time: a light request waits for its slot.
    assert await harness.send_at(Charge(TEN_PER_SECOND, 1)) == 0.6


async def test_providers_and_buckets_do_not_share_debt(harness: Harness) -> None:
    charge = Charge(TEN_PER_SECOND, 1)
    await harness.send_at(charge)
    other_provider = f"{harness.provider}-other"
    assert await harness.send_at(charge, provider=other_provider) == 0.0
    assert await harness.send_at(Charge(Bucket("tenant:acme:tokens", 10, 1), 1)) == 0.0
    assert await harness.send_at(charge) == 0.1


async def test_a_pause_holds_every_bucket_and_is_never_shortened(harness: Harness) -> None:
    plan = QuotaPlan(requests_per_second=10, burst_seconds=0.5, query_reserve=0.5)
    index_charges = plan.charges(Purpose.INDEX, 0)
    assert {c.bucket.name for c in index_charges} == {REQUESTS, INDEXING_REQUESTS}
    await harness.send_at(*index_charges)  # the buckets exist before the pause

    view = await harness.store.pause(harness.provider, seconds=10, plan=plan)
    assert view.paused_until == harness.at(10)
    assert view.paused
    shorter = await harness.store.pause(harness.provider, seconds=3, plan=plan)
    assert shorter.paused_until == harness.at(10)
    assert (await harness.store.view(harness.provider)).paused_until == harness.at(10)

    # Moved to paused_until + tau: requests resume one period after the pause, not in a
    # burst of five. The query's buckets are the totals (10/s); indexing's is 5/s.
    assert await harness.send_at(*plan.charges(Purpose.QUERY, 0)) == 10.1
    assert await harness.send_at(*index_charges) == 10.2
    # A reservation too far away is refused, with the wait.
    refused = await harness.store.reserve(harness.provider, index_charges, max_wait_seconds=5)
    assert not refused.granted
    assert refused.wait_seconds == pytest.approx(10.4)


async def test_a_pause_with_no_bucket_yet_is_honoured(harness: Harness) -> None:
    await harness.store.pause(harness.provider, seconds=4, plan=QuotaPlan())
    assert await harness.send_at(Charge(TEN_PER_SECOND, 1)) == 4.0
    harness.clock.advance(5)
    assert not (await harness.store.view(harness.provider)).paused


async def test_failures_across_callers_open_the_breaker_at_the_threshold(
    harness: Harness,
) -> None:
    await harness.fail(2)
    view = await harness.store.view(harness.provider)
    assert (view.state, view.consecutive_failures) == (BreakerState.CLOSED, 2)
    await harness.fail()
    view = await harness.store.view(harness.provider)
    assert view.state is BreakerState.OPEN
    assert view.consecutive_failures == 3
    assert view.breaker.opened_at == harness.clock.now()
    assert view.open_until == harness.at(30)
    assert view.breaker.last_failure_code == DOWN
    assert view.updated_at == harness.clock.now()


async def test_a_success_closes_and_resets(harness: Harness) -> None:
    await harness.fail(3)
    view = await harness.store.record_success(harness.provider)
    assert view.breaker.pristine
    assert view.breaker.last_success_at == harness.clock.now()
    assert (await harness.store.view(harness.provider)).breaker == view.breaker


async def test_exactly_one_concurrent_caller_takes_the_probe(harness: Harness) -> None:
    await harness.fail(3)
    early = await harness.store.take_probe(harness.provider, owner="early", policy=POLICY)
    assert not early.won
    assert early.view.state is BreakerState.OPEN
    harness.clock.advance(30)
    taken = await asyncio.gather(
        *(
            harness.store.take_probe(harness.provider, owner=f"w{i}", policy=POLICY)
            for i in range(8)
        )
    )
    winners = [t.view.probe_owner for t in taken if t.won]
    assert len(winners) == 1
    view = await harness.store.view(harness.provider)
    assert (view.state, view.probe_owner) == (BreakerState.HALF_OPEN, winners[0])
    assert view.probe_until == harness.at(60)
    # Every loser saw the winner.
    assert {t.view.probe_owner for t in taken} == {winners[0]}


async def test_a_failed_probe_reopens_for_twice_as_long(harness: Harness) -> None:
    await harness.fail(3)
    harness.clock.advance(30)
    assert (await harness.store.take_probe(harness.provider, owner="a", policy=POLICY)).won
    await harness.fail(probe_owner="a")
    view = await harness.store.view(harness.provider)
    assert view.state is BreakerState.OPEN
    assert (view.breaker.opened_at, view.open_until) == (harness.clock.now(), harness.at(60))
    assert view.probe_owner is None
    harness.clock.advance(60)
    assert (await harness.store.take_probe(harness.provider, owner="b", policy=POLICY)).won
    await harness.fail(probe_owner="b")
    assert (await harness.store.view(harness.provider)).open_until == harness.at(100)  # max


async def test_a_vanished_probe_owner_yields_after_probe_seconds(harness: Harness) -> None:
    await harness.fail(3)
    harness.clock.advance(30)
    assert (await harness.store.take_probe(harness.provider, owner="gone", policy=POLICY)).won
    harness.clock.advance(59)
    assert not (await harness.store.take_probe(harness.provider, owner="b", policy=POLICY)).won
    harness.clock.advance(1)
    taken = await harness.store.take_probe(harness.provider, owner="b", policy=POLICY)
    assert taken.won
    assert taken.view.probe_owner == "b"
    # The vanished owner's late failure does not reopen; the new probe's success closes.
    await harness.fail(probe_owner="gone")
    assert (await harness.store.view(harness.provider)).state is BreakerState.HALF_OPEN
    await harness.store.record_success(harness.provider)
    assert (await harness.store.view(harness.provider)).state is BreakerState.CLOSED


async def test_concurrent_reservations_each_get_their_own_slot(harness: Harness) -> None:
    charge = Charge(TEN_PER_SECOND, 1)
    await harness.send_at(charge)  # the bucket exists: the race is on its row lock
    sends = await asyncio.gather(*(harness.send_at(charge) for _ in range(12)))
    # Read-modify-write without the lock would hand two callers the same slot.
    assert sorted(sends) == [pytest.approx(0.1 * k) for k in range(1, 13)]


async def test_concurrent_reservations_and_pauses_on_overlapping_buckets_finish(
    harness: Harness,
) -> None:
    """Buckets taken in every order, pauses between: none deadlocks, every slot distinct."""
    plan = QuotaPlan(
        requests_per_second=10, tokens_per_second=1000, tenant_share=0.5, burst_seconds=0.1
    )
    index = plan.charges(Purpose.INDEX, 10)
    query = plan.charges(Purpose.QUERY, 10)
    tenant = plan.tenant_charge("acme", 10)
    assert tenant is not None
    reserving: list[asyncio.Task[Reservation]] = []
    pausing: list[asyncio.Task[ProviderView]] = []
    for i in range(18):  # started in this order, interleaved
        charges = [index, list(reversed(index)), query, [tenant, *query]][i % 4]
        reserve = harness.store.reserve(harness.provider, charges, max_wait_seconds=1e6)
        reserving.append(asyncio.create_task(reserve))
        if i % 6 == 5:
            pause = harness.store.pause(harness.provider, seconds=1, plan=plan)
            pausing.append(asyncio.create_task(pause))
    async with asyncio.timeout(30):
        reservations = await asyncio.gather(*reserving)
        await asyncio.gather(*pausing)
    send_times = [r.send_at for r in reservations]
    # Every request takes the 10/s requests bucket: no two in the same slot.
    assert len(set(send_times)) == 18
