"""The shared pause is capped (KB_EMBEDDING_RATE_MAX_PAUSE_SECONDS): a Retry-After beyond
the cap opens the breaker instead of stopping every process for as long as it asks."""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY

from services.embedding.guard.breaker import BreakerPolicy, BreakerState
from services.embedding.guard.factory import guard_timing
from services.embedding.guard.guard import ClaimAllowance, Purpose
from services.embedding.guard.guarded import GuardedEmbedder
from services.embedding.guard.quota import QuotaPlan
from services.embedding.settings import load_embedding_settings
from services.runtime.errors import ConfigError, DependencyUnavailable
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from tests.unit.embedding.guard.fakes import ScriptedEmbedder, World

POLICY = BreakerPolicy(failure_threshold=5, open_seconds=10, max_open_seconds=40)
A_YEAR = 365 * 24 * 3600.0


def throttled(retry_after: float | None) -> IndexingFailed:
    return IndexingFailed(ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=retry_after)


def capped_count(world: World) -> float:
    sample = REGISTRY.get_sample_value(
        "kb_embedding_retry_after_capped_total", {"provider": world.provider}
    )
    return sample or 0.0


async def test_a_retry_after_within_the_cap_pauses_every_process_as_before() -> None:
    world = World()
    guard = world.guard(policy=POLICY, max_pause_seconds=300)
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    assert await guard.after_request(owner="w", error=throttled(300), purpose=Purpose.INDEX) is None
    view = await guard.view()
    assert view.state is BreakerState.CLOSED
    assert view.seconds_until(view.paused_until) == pytest.approx(300)
    assert capped_count(world) == 0


@pytest.mark.parametrize("retry_after", [A_YEAR, 300.5, math.inf, math.nan])
async def test_a_retry_after_beyond_the_cap_opens_the_breaker_instead(retry_after: float) -> None:
    world = World()
    guard = world.guard(policy=POLICY, max_pause_seconds=300)
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    instead = await guard.after_request(
        owner="w", error=throttled(retry_after), purpose=Purpose.INDEX
    )
    view = await guard.view()
    assert not view.paused
    assert view.state is BreakerState.OPEN  # at once, whatever the failure threshold
    assert view.seconds_until(view.open_until) == pytest.approx(10)
    assert capped_count(world) == 1
    # The task waits for the breaker's probe, not for the Retry-After.
    assert instead is not None
    assert instead.code == ErrorCode.EMBEDDING_RATE_LIMITED
    assert instead.retry_after_seconds == pytest.approx(10)
    assert await guard.claim_allowance("w") == ClaimAllowance(0, 10.0, "breaker_open")
    # After the open time one caller probes; an answer closes the breaker.
    world.clock.advance(10)
    assert (await guard.claim_allowance("w")).limit == 1
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    assert await guard.after_request(owner="w", error=None, purpose=Purpose.INDEX) is None
    assert (await guard.view()).breaker.pristine


async def test_a_probe_answered_with_a_long_retry_after_reopens_for_longer() -> None:
    world = World()
    guard = world.guard(policy=POLICY, max_pause_seconds=300)
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    await guard.after_request(owner="w", error=throttled(A_YEAR), purpose=Purpose.INDEX)
    world.clock.advance(10)
    assert (await guard.claim_allowance("w")).limit == 1
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    await guard.after_request(owner="w", error=throttled(A_YEAR), purpose=Purpose.INDEX)
    view = await guard.view()
    assert view.state is BreakerState.OPEN
    assert view.seconds_until(view.open_until) == pytest.approx(20)


async def test_a_retry_after_beyond_the_cap_is_not_waited_for_when_the_breaker_cannot_open() -> (
    None
):
    world = World()
    guard = world.guard(policy=POLICY, max_pause_seconds=300)
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    world.store.fail_with = DependencyUnavailable("database down")
    instead = await guard.after_request(owner="w", error=throttled(A_YEAR), purpose=Purpose.INDEX)
    assert instead is not None
    assert instead.retry_after_seconds == pytest.approx(300)


async def test_the_guarded_embedder_raises_the_capped_error() -> None:
    world = World()
    guard = world.guard(policy=POLICY, max_pause_seconds=300)
    embedder = GuardedEmbedder(
        ScriptedEmbedder(throttled(A_YEAR)), guard, purpose=Purpose.INDEX, owner="w"
    )
    with pytest.raises(IndexingFailed) as caught:
        await embedder.embed(["text"])
    assert caught.value.code == ErrorCode.EMBEDDING_RATE_LIMITED
    assert caught.value.retry_after_seconds == pytest.approx(10)
    assert "breaker opened" in caught.value.message


def test_the_cap_is_a_setting_and_not_below_the_default_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert guard_timing(load_embedding_settings()).max_pause_seconds == 300
    monkeypatch.setenv("KB_EMBEDDING_RATE_MAX_PAUSE_SECONDS", "60")
    assert guard_timing(load_embedding_settings()).max_pause_seconds == 60
    monkeypatch.setenv("KB_EMBEDDING_RATE_DEFAULT_PAUSE_SECONDS", "120")
    with pytest.raises(ConfigError, match="KB_EMBEDDING_RATE_MAX_PAUSE_SECONDS"):
        load_embedding_settings()


async def test_a_pause_beyond_the_cap_already_shared_is_cut_to_it() -> None:
    world = World()
    plan = QuotaPlan(requests_per_second=1.0)
    # What a process without the cap left behind: a year's pause, its buckets owing it.
    await world.store.pause(world.provider, seconds=A_YEAR, plan=plan)
    guard = world.guard(plan=plan, policy=POLICY, max_pause_seconds=300)
    assert await guard.claim_allowance("w") == ClaimAllowance(0, 300.0, "paused")
    assert (await world.store.view(world.provider)).seconds_until(
        (await world.store.view(world.provider)).paused_until
    ) == pytest.approx(300)
    world.clock.advance(302)
    assert await guard.claim_allowance("w") == ClaimAllowance(None)
    # The buckets were cut too: a request goes at once.
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w")
    assert world.sleeps == []
