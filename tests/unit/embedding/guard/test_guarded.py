"""GuardedEmbedder around a scripted provider, on the memory store and a clock that moves
only when a wait sleeps: what each outcome does to every process's requests."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from prometheus_client import REGISTRY

from services.embedding.guard.breaker import BreakerPolicy, BreakerState
from services.embedding.guard.guard import ClaimAllowance
from services.embedding.guard.guarded import GuardedEmbedder
from services.embedding.guard.quota import Purpose, QuotaPlan
from services.embedding.port import InputRefused
from services.runtime.errors import DatabaseUnavailable
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from tests.unit.embedding.guard.fakes import ScriptedEmbedder, World

DOWN = ErrorCode.EMBEDDING_UNAVAILABLE
POLICY = BreakerPolicy(failure_threshold=2, open_seconds=30, max_open_seconds=300)


def failure(code: str, retry_after: float | None = None) -> IndexingFailed:
    return IndexingFailed(code, "scripted", retry_after_seconds=retry_after)


def guarded(
    world: World,
    inner: ScriptedEmbedder,
    *,
    purpose: Purpose = Purpose.INDEX,
    plan: QuotaPlan | None = None,
    owner: str | None = None,
    refresh_seconds: float = 0.0,
) -> GuardedEmbedder:
    """Another process's embedder: its own guard, its own owner, on the shared store."""
    guard = world.guard(plan=plan, policy=POLICY, refresh_seconds=refresh_seconds)
    return GuardedEmbedder(inner, guard, purpose=purpose, owner=owner or f"proc-{id(guard)}")


def counted(world: World, result: str, purpose: str = "index") -> float:
    value = REGISTRY.get_sample_value(
        "kb_embedding_requests_total",
        {"provider": world.provider, "purpose": purpose, "result": result},
    )
    return value or 0.0


async def fails(embedder: GuardedEmbedder, code: str) -> IndexingFailed:
    with pytest.raises(IndexingFailed) as caught:
        await embedder.embed(["text"])
    assert caught.value.code == code
    return caught.value


async def open_breaker(world: World) -> None:
    opener = guarded(world, ScriptedEmbedder(failure(DOWN), failure(DOWN)))
    await fails(opener, DOWN)
    await fails(opener, DOWN)
    assert (await opener.guard.view()).state is BreakerState.OPEN


async def test_a_429_pauses_every_process_of_the_provider() -> None:
    world = World()
    first = guarded(world, ScriptedEmbedder(failure(ErrorCode.EMBEDDING_RATE_LIMITED, 5.0)))
    other_inner = ScriptedEmbedder()
    other = guarded(world, other_inner)

    await fails(first, ErrorCode.EMBEDDING_RATE_LIMITED)
    view = await other.guard.view()
    assert view.paused_until == world.clock.now() + timedelta(seconds=5)
    assert await other.guard.claim_allowance("w2") == ClaimAllowance(0, 5.0, "paused")

    await other.embed(["b"])  # waits out the pause, then goes
    assert world.sleeps == [5.0]
    assert other_inner.calls == 1
    assert (counted(world, "rate_limited"), counted(world, "ok")) == (1, 1)
    # A 429 is not a provider failure: the breaker counted nothing.
    assert (await other.guard.view()).breaker.pristine
    assert await other.guard.claim_allowance("w2") == ClaimAllowance(None)


async def test_after_a_pause_requests_resume_spaced_by_the_rate() -> None:
    world = World()
    plan = QuotaPlan(requests_per_second=10, burst_seconds=1, query_reserve=0)
    first = guarded(world, ScriptedEmbedder(failure(ErrorCode.EMBEDDING_RATE_LIMITED)), plan=plan)
    await fails(first, ErrorCode.EMBEDDING_RATE_LIMITED)  # no Retry-After: the default 1 s
    world.sleeps.clear()
    others = [guarded(world, ScriptedEmbedder(), plan=plan) for _ in range(3)]
    for other in others:
        await other.embed(["x"])
    # Not a burst of ten at the end of the pause: one period after it, then one apart.
    start = world.clock.now() - timedelta(seconds=sum(world.sleeps))
    assert world.sleeps == [1.1, 0.1, 0.1]
    assert world.clock.now() == start + timedelta(seconds=1.3)


async def test_a_pause_longer_than_a_query_may_wait_fails_the_query_at_once() -> None:
    world = World()
    first = guarded(world, ScriptedEmbedder(failure(ErrorCode.EMBEDDING_RATE_LIMITED, 60.0)))
    await fails(first, ErrorCode.EMBEDDING_RATE_LIMITED)
    query_inner = ScriptedEmbedder()
    query = guarded(world, query_inner, purpose=Purpose.QUERY)
    refused = await fails(query, ErrorCode.EMBEDDING_RATE_LIMITED)
    assert refused.retry_after_seconds == pytest.approx(60.0)
    assert query_inner.calls == 0
    assert world.sleeps == []
    assert counted(world, "short_circuited", "query") == 1


async def test_an_open_breaker_short_circuits_every_process() -> None:
    world = World()
    await open_breaker(world)
    inner = ScriptedEmbedder()
    other = guarded(world, inner)
    refused = await fails(other, DOWN)
    assert inner.calls == 0
    assert refused.retry_after_seconds == pytest.approx(30.0)
    assert "circuit open" in refused.message
    assert counted(world, "short_circuited") == 1
    assert counted(world, "unavailable") == 2
    assert await other.guard.claim_allowance("w") == ClaimAllowance(0, 30.0, "breaker_open")


async def test_one_probe_at_a_time_and_its_answer_closes_the_breaker() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(30)
    probe_inner = ScriptedEmbedder()
    probe_inner.gate = asyncio.Event()
    prober = guarded(world, probe_inner, owner="prober")
    other_inner = ScriptedEmbedder()
    other = guarded(world, other_inner)

    probing = asyncio.create_task(prober.embed(["probe"]))
    await probe_inner.entered.wait()  # the probe is at the provider
    view = await other.guard.view()
    assert (view.state, view.probe_owner) == (BreakerState.HALF_OPEN, "prober")
    # Another process, and the prober's own second request, wait for the probe's answer.
    await fails(other, DOWN)
    second = asyncio.create_task(prober.embed(["second"]))
    await fails_task(second, DOWN)
    assert other_inner.calls == 0
    assert probe_inner.calls == 1

    probe_inner.gate.set()
    await probing
    assert (await other.guard.view()).breaker.pristine
    await other.embed(["after"])
    assert other_inner.calls == 1


async def fails_task(task: asyncio.Task[object], code: str) -> None:
    with pytest.raises(IndexingFailed) as caught:
        await task
    assert caught.value.code == code


async def test_a_failed_probe_reopens_for_twice_as_long() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(30)
    prober = guarded(world, ScriptedEmbedder(failure(ErrorCode.EMBEDDING_TIMEOUT)))
    await fails(prober, ErrorCode.EMBEDDING_TIMEOUT)
    view = await prober.guard.view()
    assert view.state is BreakerState.OPEN
    assert view.open_until == world.clock.now() + timedelta(seconds=60)
    assert view.breaker.last_failure_code == ErrorCode.EMBEDDING_TIMEOUT


async def test_the_claim_that_won_the_probe_lends_it_to_its_process() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(30)
    inner = ScriptedEmbedder()
    embedder = guarded(world, inner)
    guard = embedder.guard
    assert await guard.claim_allowance("worker-1") == ClaimAllowance(1, None, "probing")
    # Nobody else claims while the probe is out, this process included.
    other = world.guard(policy=POLICY)
    assert await other.claim_allowance("worker-2") == ClaimAllowance(0, 1.0, "probing")
    assert await guard.claim_allowance("worker-1") == ClaimAllowance(0, 1.0, "probing")
    # The claimed task's request (the embedder's owner is the process) is the probe.
    await embedder.embed(["probe"])
    assert inner.calls == 1
    assert await other.claim_allowance("worker-2") == ClaimAllowance(None)


async def test_a_refused_input_is_an_answer_not_a_failure() -> None:
    world = World()
    breaks_at_one = BreakerPolicy(failure_threshold=1)
    inner = ScriptedEmbedder(InputRefused(0, "too long"))
    embedder = GuardedEmbedder(
        inner, world.guard(policy=breaks_at_one), purpose=Purpose.INDEX, owner="proc"
    )
    with pytest.raises(InputRefused):
        await embedder.embed(["long"])
    view = await embedder.guard.view()
    assert view.state is BreakerState.CLOSED
    assert view.consecutive_failures == 0
    assert counted(world, "refused") == 1
    # The same policy does open on one real failure: the test above can tell them apart.
    failing = GuardedEmbedder(
        ScriptedEmbedder(failure(DOWN)),
        world.guard(policy=breaks_at_one),
        purpose=Purpose.INDEX,
        owner="proc",
    )
    await fails(failing, DOWN)
    assert (await failing.guard.view()).state is BreakerState.OPEN


async def test_a_success_after_failures_resets_the_count_with_one_write() -> None:
    world = World()
    embedder = guarded(world, ScriptedEmbedder(failure(DOWN)))
    await fails(embedder, DOWN)
    assert (await embedder.guard.view()).consecutive_failures == 1
    for _ in range(3):
        await embedder.embed(["ok"])
    assert world.store.calls["record_success"] == 1
    assert (await embedder.guard.view()).breaker.pristine


async def test_without_a_rate_a_healthy_request_costs_no_store_round_trip() -> None:
    world = World()
    guard = world.guard(refresh_seconds=10)
    embedder = GuardedEmbedder(ScriptedEmbedder(), guard, purpose=Purpose.INDEX, owner="p")
    for _ in range(20):
        await embedder.embed(["ok"])
    assert dict(world.store.calls) == {"view": 1}
    assert world.sleeps == []


async def test_with_a_rate_each_request_reserves_its_send_time() -> None:
    world = World()
    plan = QuotaPlan(requests_per_second=4, burst_seconds=0.25, query_reserve=0.5)
    index = guarded(world, ScriptedEmbedder(), plan=plan)
    for _ in range(3):
        await index.embed(["x"])
    assert world.store.calls["reserve"] == 3
    # Indexing gets half the rate: one request per 0.5 s.
    assert world.sleeps == [0.5, 0.5]
    world.sleeps.clear()
    query = guarded(world, ScriptedEmbedder(), plan=plan, purpose=Purpose.QUERY)
    await query.embed(["q"])
    # Indexing has used its half: the query waits only for the total rate's next slot
    # (one period of 4/s), where the next indexing request would wait 0.5 s.
    assert world.sleeps == [0.25]


async def test_a_cancelled_probe_lets_the_next_request_probe() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(30)
    inner = ScriptedEmbedder()
    inner.gate = asyncio.Event()
    embedder = guarded(world, inner)
    probing = asyncio.create_task(embedder.embed(["probe"]))
    await inner.entered.wait()
    probing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probing
    inner.gate.set()
    await embedder.embed(["probe again"])
    assert inner.calls == 2
    assert (await embedder.guard.view()).breaker.pristine


async def test_a_store_failure_after_the_request_never_hides_its_outcome() -> None:
    world = World()
    embedder = guarded(world, ScriptedEmbedder(failure(DOWN)), refresh_seconds=60)
    await embedder.guard.view()
    world.store.fail_with = DatabaseUnavailable("down")
    error = await fails(embedder, DOWN)
    assert error.message == "scripted"


async def test_tenant_shares_wait_per_tenant_and_are_off_by_default() -> None:
    world = World()
    plan = QuotaPlan(tokens_per_second=100, tenant_share=0.5, burst_seconds=1)
    guard = world.guard(plan=plan)
    await guard.tenant_share("acme", 50)  # acme's burst
    await guard.tenant_share("globex", 50)  # another tenant: its own share
    assert world.sleeps == []
    await guard.tenant_share("acme", 50)
    assert world.sleeps == [1.0]
    # A task bigger than the burst goes when its tenant's bucket is free, then the tenant
    # owes all of it: 1000 s of acme's share, more than the 30 s a task may wait.
    await guard.tenant_share("acme", 50_000)
    assert world.sleeps == [1.0, 1.0]
    with pytest.raises(IndexingFailed) as caught:
        await guard.tenant_share("acme", 1)
    assert caught.value.code == ErrorCode.EMBEDDING_RATE_LIMITED
    assert caught.value.retry_after_seconds == pytest.approx(1000.0, abs=1)
    await guard.tenant_share("globex", 1)  # another tenant still goes
    off = World()
    await off.guard().tenant_share("acme", 10**9)
    assert dict(off.store.calls) == {}
