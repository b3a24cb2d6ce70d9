"""ProviderGuard on the memory store: the claim gate, the copy of the shared state, and how
the settings build it."""

from __future__ import annotations

import asyncio

import pytest

from services.embedding.guard.breaker import BreakerPolicy, BreakerState
from services.embedding.guard.factory import build_guard, quota_plan
from services.embedding.guard.guard import ClaimAllowance, Purpose
from services.embedding.guard.identity import provider_key
from services.embedding.guard.quota import INDEXING_TOKENS, TOKENS
from services.embedding.guard.store_memory import InMemoryProviderStateStore
from services.embedding.settings import (
    HashingConfig,
    OnnxLocalConfig,
    OpenAIConfig,
    load_embedding_settings,
)
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from tests.unit.embedding.guard.fakes import World

POLICY = BreakerPolicy(failure_threshold=1, open_seconds=10, probe_seconds=20)
DOWN = IndexingFailed(ErrorCode.EMBEDDING_UNAVAILABLE, "down")


async def open_breaker(world: World) -> None:
    guard = world.guard(policy=POLICY)
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="x")
    await guard.after_request(owner="x", error=DOWN, purpose=Purpose.INDEX)


async def test_a_closed_unpaused_provider_sets_no_limit() -> None:
    world = World()
    assert await world.guard().claim_allowance("w") == ClaimAllowance(None, None, None)


async def test_the_shared_state_is_read_at_most_once_per_refresh_interval() -> None:
    world = World()
    guard = world.guard(refresh_seconds=0.5)
    for _ in range(5):
        await guard.claim_allowance("w")
        await guard.before_request(tokens=3, purpose=Purpose.QUERY, owner="w")
        await guard.after_request(owner="w", error=None, purpose=Purpose.QUERY)
    assert world.store.calls["view"] == 1
    world.clock.advance(0.5)
    await guard.claim_allowance("w")
    assert world.store.calls["view"] == 2
    # Concurrent callers share one refresh.
    world.clock.advance(0.5)
    await asyncio.gather(*(guard.claim_allowance(f"w{i}") for i in range(10)))
    assert world.store.calls["view"] == 3


async def test_exactly_one_of_many_concurrent_claimers_wins_the_probe() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(10)
    guards = [world.guard(policy=POLICY) for _ in range(10)]
    allowances = await asyncio.gather(
        *(guard.claim_allowance(f"worker-{i}") for i, guard in enumerate(guards))
    )
    assert sorted(a.limit for a in allowances if a.limit is not None) == [0] * 9 + [1]
    assert {a.reason for a in allowances} == {"probing"}


async def test_a_vanished_probe_owner_gives_the_probe_to_another_after_probe_seconds() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(10)
    gone, other = world.guard(policy=POLICY), world.guard(policy=POLICY)
    assert (await gone.claim_allowance("gone")).limit == 1
    # ... and its process dies with the probe.
    world.clock.advance(19)
    assert await other.claim_allowance("other") == ClaimAllowance(0, 1.0, "probing")
    with pytest.raises(IndexingFailed) as caught:
        await other.before_request(tokens=1, purpose=Purpose.QUERY, owner="other")
    assert caught.value.code == ErrorCode.EMBEDDING_UNAVAILABLE
    assert caught.value.retry_after_seconds == pytest.approx(1.0)
    world.clock.advance(1)
    assert await other.claim_allowance("other") == ClaimAllowance(1, None, "probing")
    view = await other.view()
    assert (view.state, view.probe_owner) == (BreakerState.HALF_OPEN, "other")


async def test_a_caller_that_finds_the_breaker_due_probes_itself() -> None:
    """Search never asks for claims: its query, arriving when the breaker is due, is the
    probe."""
    world = World()
    await open_breaker(world)
    world.clock.advance(10)
    search = world.guard(policy=POLICY)
    await search.before_request(tokens=1, purpose=Purpose.QUERY, owner="search")
    await search.after_request(owner="search", error=None, purpose=Purpose.QUERY)
    assert (await search.view()).breaker.pristine


async def test_a_rate_limit_raised_by_the_limiter_frees_the_probe() -> None:
    world = World()
    await open_breaker(world)
    world.clock.advance(10)
    pause = IndexingFailed(ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=100)
    paused = world.guard(policy=POLICY)
    await paused.before_request(tokens=1, purpose=Purpose.INDEX, owner="p")
    await paused.after_request(owner="p", error=pause, purpose=Purpose.INDEX)
    # The probe got a 429: the provider answers, the breaker closes, the pause holds.
    view = await paused.view()
    assert view.state is BreakerState.CLOSED
    assert await paused.claim_allowance("p") == ClaimAllowance(0, 100.0, "paused")
    with pytest.raises(IndexingFailed) as caught:
        await paused.before_request(tokens=1, purpose=Purpose.INDEX, owner="p")
    assert caught.value.code == ErrorCode.EMBEDDING_RATE_LIMITED


def test_provider_keys_name_the_quota_and_hold_no_secret() -> None:
    openai = OpenAIConfig(
        base_url="https://user:sk-secret@API.Example.com:8443/v1/?key=sk-other#frag",
        model="text-embedding-3-small",
        dimensions=8,
    )
    assert provider_key(openai) == "openai:https://api.example.com:8443/v1#text-embedding-3-small"
    assert provider_key(OnnxLocalConfig()) == "onnx-local:all-MiniLM-L6-v2-onnx-int8"
    assert provider_key(HashingConfig(dimensions=7)) == "hashing:7"


def test_the_onnx_model_name_is_the_one_onnx_local_runs() -> None:
    from services.embedding.guard.identity import ONNX_LOCAL_MODEL
    from services.embedding.onnx_local import MODEL_NAME

    assert ONNX_LOCAL_MODEL == MODEL_NAME


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("KB_EMBEDDING_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_the_settings_read_their_variables_and_build_the_plan(
    clean_env: pytest.MonkeyPatch,
) -> None:
    monkeypatch = clean_env
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "hashing")
    monkeypatch.setenv("KB_EMBEDDING_RATE_REQUESTS_PER_SECOND", "50")
    monkeypatch.setenv("KB_EMBEDDING_RATE_TOKENS_PER_MINUTE", "600000")
    monkeypatch.setenv("KB_EMBEDDING_RATE_QUERY_RESERVE", "0.25")
    monkeypatch.setenv("KB_EMBEDDING_BREAKER_FAILURE_THRESHOLD", "3")
    settings = load_embedding_settings()
    plan = quota_plan(settings)
    assert plan.requests_per_second == 50
    assert plan.tokens_per_second == pytest.approx(10_000)
    index_tokens = plan.bucket(INDEXING_TOKENS)
    total_tokens = plan.bucket(TOKENS)
    assert index_tokens is not None
    assert total_tokens is not None
    assert index_tokens.rate == pytest.approx(7_500)
    assert total_tokens.burst == pytest.approx(10_000)  # one second of the rate
    guard = build_guard(settings, None, "host-1")
    assert guard.provider == "hashing:384"
    assert guard.owner == "host-1"
    store = InMemoryProviderStateStore()
    assert build_guard(settings, store, "host-1")._store is store


@pytest.mark.usefixtures("clean_env")
def test_defaults_leave_the_limiter_off() -> None:
    settings = load_embedding_settings(provider={"kind": "hashing"})
    assert not quota_plan(settings).limits
    assert settings.breaker_failure_threshold == 5
    assert settings.rate_query_max_wait_seconds == 1.0
