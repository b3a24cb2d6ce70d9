"""Fair shares (services/runtime/fair_share): the token bucket, each tenant's cap and
bucket, the search slots' order between tenants, and the settings per tier. Time is a
number the test moves; tasks are ordered by letting the loop run, never by sleeping."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from services.app import FAIR_SHARE_ROUTES, create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Vectors
from services.publisher.settings import PublisherSettings
from services.runtime.fair_share.bucket import TokenBucket
from services.runtime.fair_share.gate import FairShare
from services.runtime.fair_share.middleware import LimitedRoute
from services.runtime.fair_share.phases import between_search_phases
from services.runtime.fair_share.settings import FairShareSettings, Kind, Limits, TierLimits
from services.runtime.fair_share.shares import (
    SWEEP_SECONDS,
    TenantConcurrencyLimited,
    TenantRateLimited,
    TenantShares,
)
from services.runtime.fair_share.slots import SearchSlots
from services.runtime.fair_share.tiers import CachedTiers
from services.search.searcher import Candidates, Searcher, SearchRequest
from tests.fakes.search_index import DIMENSION, FakeIndex


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    """Let every ready task run until it waits again."""
    for _ in range(10):
        await asyncio.sleep(0)


# --- the token bucket ---------------------------------------------------------------------


def test_a_bucket_lets_a_burst_through_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, updated=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token every half second
    assert bucket.take(0.25) == pytest.approx(0.25)
    assert bucket.take(0.5) == 0.0
    assert not bucket.is_full(0.5)
    assert bucket.is_full(2.0)  # 1.5 s refill 3 tokens, and no more
    assert [bucket.take(10.0) for _ in range(4)][-1] > 0


def test_a_bucket_keeps_what_was_spent_when_its_limits_change() -> None:
    bucket = TokenBucket(rate=1.0, burst=10, updated=0.0)
    for _ in range(8):
        bucket.take(0.0)
    bucket.adjust(rate=1.0, burst=5)
    assert bucket.tokens == 2.0
    bucket.adjust(rate=1.0, burst=1)
    assert bucket.tokens == 1.0


# --- each tenant's share ------------------------------------------------------------------


def test_a_tenant_at_its_cap_is_refused_and_others_are_not() -> None:
    shares = TenantShares(Clock())
    limits = Limits(concurrency=2, rate=0.0, burst=1)
    shares.enter("acme", Kind.SEARCH, limits)
    shares.enter("acme", Kind.SEARCH, limits)
    with pytest.raises(TenantConcurrencyLimited) as refused:
        shares.enter("acme", Kind.SEARCH, limits)
    assert refused.value.http_status == 429
    assert refused.value.code == "TENANT_CONCURRENCY_LIMITED"
    assert refused.value.retry_after_seconds == 1
    # Another tenant, and another kind of the same tenant, have shares of their own.
    shares.enter("globex", Kind.SEARCH, limits)
    shares.enter("acme", Kind.PUBLISH, limits)
    shares.leave("acme", Kind.SEARCH)
    shares.enter("acme", Kind.SEARCH, limits)
    assert shares.in_flight("acme", Kind.SEARCH) == 2


def test_a_tenant_beyond_its_rate_is_told_when_to_retry() -> None:
    clock = Clock()
    shares = TenantShares(clock)
    limits = Limits(concurrency=0, rate=0.4, burst=2)
    for _ in range(2):
        shares.enter("acme", Kind.PUBLISH, limits)
        shares.leave("acme", Kind.PUBLISH)
    with pytest.raises(TenantRateLimited) as refused:
        shares.enter("acme", Kind.PUBLISH, limits)
    assert refused.value.code == "TENANT_RATE_LIMITED"
    assert refused.value.retry_after_seconds == 3  # 2.5 s until a token, rounded up
    assert shares.in_flight("acme", Kind.PUBLISH) == 0  # a refusal holds nothing
    clock.now += 2.5
    shares.enter("acme", Kind.PUBLISH, limits)


def test_a_refusal_at_the_cap_takes_no_token() -> None:
    shares = TenantShares(Clock())
    limits = Limits(concurrency=1, rate=1.0, burst=2)
    shares.enter("acme", Kind.SEARCH, limits)
    for _ in range(5):
        with pytest.raises(TenantConcurrencyLimited):
            shares.enter("acme", Kind.SEARCH, limits)
    shares.leave("acme", Kind.SEARCH)
    shares.enter("acme", Kind.SEARCH, limits)  # the second token is still there


def test_idle_tenants_are_forgotten_once_forgetting_loses_nothing() -> None:
    clock = Clock()
    shares = TenantShares(clock)
    unlimited = Limits(concurrency=4, rate=0.0, burst=1)
    rated = Limits(concurrency=4, rate=1.0, burst=5)
    for n in range(100):
        shares.enter(f"t{n}", Kind.SEARCH, unlimited)
        shares.leave(f"t{n}", Kind.SEARCH)
    assert shares.tracked() == 0  # no request in flight, no bucket: gone at once
    shares.enter("busy", Kind.SEARCH, unlimited)
    shares.enter("rated", Kind.SEARCH, rated)
    shares.leave("rated", Kind.SEARCH)
    assert shares.tracked() == 2  # its bucket is not full: forgetting it would refill it
    clock.now += SWEEP_SECONDS
    shares.enter("other", Kind.SEARCH, unlimited)
    assert shares.tracked() == 2  # "rated" swept (refilled), "busy" still in flight
    assert shares.in_flight("busy", Kind.SEARCH) == 1


# --- the search slots ---------------------------------------------------------------------


class Searches:
    """Searches that hold their slot until the test ends them."""

    def __init__(self, slots: SearchSlots) -> None:
        self.slots = slots
        self.running: list[tuple[str, int]] = []
        self.started: list[tuple[str, int]] = []
        self._ends: dict[tuple[str, int], asyncio.Event] = {}
        self.tasks: dict[tuple[str, int], asyncio.Task[None]] = {}

    def start(self, tenant: str, n: int) -> None:
        key = (tenant, n)
        self._ends[key] = asyncio.Event()
        self.tasks[key] = asyncio.create_task(self._search(key))

    async def _search(self, key: tuple[str, int]) -> None:
        async with self.slots.slot(key[0]):
            self.started.append(key)
            self.running.append(key)
            await self._ends[key].wait()
            self.running.remove(key)

    async def end(self, tenant: str, n: int) -> None:
        self._ends[(tenant, n)].set()
        await settle()


async def test_a_quiet_tenant_waits_behind_one_running_search_not_the_queue() -> None:
    searches = Searches(SearchSlots(2))
    for n in range(10):  # acme floods: 2 run, 8 wait
        searches.start("acme", n)
    await settle()
    assert searches.running == [("acme", 0), ("acme", 1)]
    searches.start("globex", 0)
    await settle()
    assert searches.slots.waiting() == 9
    await searches.end("acme", 0)
    # The slot goes to the tenant running fewest, however long acme's queue.
    assert searches.running == [("acme", 1), ("globex", 0)]
    await searches.end("acme", 1)
    assert searches.running == [("globex", 0), ("acme", 2)]
    for task in searches.tasks.values():
        task.cancel()
    await settle()


async def test_with_one_slot_the_quiet_tenant_is_next_not_after_the_floods_next() -> None:
    searches = Searches(SearchSlots(1))
    for n in range(5):
        searches.start("acme", n)
    await settle()
    searches.start("globex", 0)
    await settle()
    # Both run nothing once acme's search ends: the one served least recently goes first.
    await searches.end("acme", 0)
    assert searches.running == [("globex", 0)]
    await searches.end("globex", 0)
    assert searches.running == [("acme", 1)]
    for task in searches.tasks.values():
        task.cancel()
    await settle()


async def test_waiting_tenants_take_turns() -> None:
    searches = Searches(SearchSlots(1))
    searches.start("hold", 0)
    await settle()
    for n in range(3):
        searches.start("acme", n)
        searches.start("globex", n)
    searches.start("initech", 0)
    await settle()
    for key in [("hold", 0), ("acme", 0), ("globex", 0), ("initech", 0), ("acme", 1)]:
        await searches.end(*key)
    assert searches.started == [
        ("hold", 0),
        ("acme", 0),
        ("globex", 0),
        ("initech", 0),
        ("acme", 1),
        ("globex", 1),
    ]
    for task in searches.tasks.values():
        task.cancel()
    await settle()


async def test_a_search_abandoned_while_waiting_gives_its_turn_away() -> None:
    searches = Searches(SearchSlots(1))
    searches.start("acme", 0)
    searches.start("acme", 1)
    searches.start("globex", 0)
    await settle()
    searches.tasks[("acme", 1)].cancel()
    await settle()
    assert searches.slots.waiting() == 1
    await searches.end("acme", 0)
    assert searches.running == [("globex", 0)]
    await searches.end("globex", 0)
    assert searches.slots.in_use == 0
    assert searches.slots.waiting() == 0


async def test_a_search_abandoned_as_its_slot_is_granted_hands_the_slot_on() -> None:
    slots = SearchSlots(1)
    held = slots.slot("acme")
    await held.__aenter__()
    searches = Searches(slots)
    searches.start("globex", 0)
    searches.start("initech", 0)
    await settle()
    await held.__aexit__(None, None, None)  # hands the slot to globex ...
    searches.tasks[("globex", 0)].cancel()  # ... which goes away before it runs
    await settle()
    assert searches.running == [("initech", 0)]
    await searches.end("initech", 0)
    assert slots.in_use == 0


class PhasedSearches(Searches):
    """Searches of two phases: each steps aside (or not) at the boundary the test reaches
    with ``next_phase``, then holds its slot until ``end``."""

    def __init__(self, slots: SearchSlots) -> None:
        super().__init__(slots)
        self.stepped_aside: list[tuple[str, int]] = []
        self._boundaries: dict[tuple[str, int], asyncio.Event] = {}

    def start(self, tenant: str, n: int) -> None:
        self._boundaries[(tenant, n)] = asyncio.Event()
        super().start(tenant, n)

    async def _search(self, key: tuple[str, int]) -> None:
        async with self.slots.slot(key[0]) as held:
            self.started.append(key)
            self.running.append(key)
            await self._boundaries[key].wait()
            self.running.remove(key)
            if await held.step_aside():
                self.stepped_aside.append(key)
            self.running.append(key)
            await self._ends[key].wait()
            self.running.remove(key)

    async def next_phase(self, tenant: str, n: int) -> None:
        self._boundaries[(tenant, n)].set()
        await settle()


async def test_a_busier_tenants_search_steps_aside_between_its_phases() -> None:
    searches = PhasedSearches(SearchSlots(1))
    for n in range(3):
        searches.start("acme", n)
    await settle()
    searches.start("globex", 0)
    await settle()
    await searches.next_phase("acme", 0)
    # acme has three searches in the process, globex one: globex runs its whole search ...
    assert searches.running == [("globex", 0)]
    await searches.next_phase("globex", 0)
    assert searches.running == [("globex", 0)]
    # ... and acme's search goes on before acme's next starts.
    await searches.end("globex", 0)
    assert searches.running == [("acme", 0)]
    assert searches.stepped_aside == [("acme", 0)]
    await searches.end("acme", 0)
    assert searches.running == [("acme", 1)]
    assert searches.slots.waiting() == 1
    for task in searches.tasks.values():
        task.cancel()
    await settle()
    assert (searches.slots.in_use, searches.slots.waiting()) == (0, 0)


async def test_a_search_keeps_its_slot_for_its_own_tenant_or_one_as_busy() -> None:
    searches = PhasedSearches(SearchSlots(1))
    searches.start("acme", 0)
    searches.start("acme", 1)
    await settle()
    await searches.next_phase("acme", 0)  # only acme waits
    searches.start("globex", 0)
    await settle()
    await searches.end("acme", 0)
    assert searches.running == [("globex", 0)]
    await searches.next_phase("globex", 0)  # acme waits, with as many searches as globex
    assert searches.stepped_aside == []
    assert searches.running == [("globex", 0)]
    for task in searches.tasks.values():
        task.cancel()
    await settle()
    assert (searches.slots.in_use, searches.slots.waiting()) == (0, 0)


async def test_a_search_abandoned_after_stepping_aside_releases_nothing_twice() -> None:
    searches = PhasedSearches(SearchSlots(1))
    searches.start("acme", 0)
    searches.start("acme", 1)
    await settle()
    searches.start("globex", 0)
    await settle()
    await searches.next_phase("acme", 0)
    assert searches.running == [("globex", 0)]
    searches.tasks[("acme", 0)].cancel()  # gone while waiting to go on
    await settle()
    assert searches.slots.in_use == 1
    await searches.next_phase("globex", 0)
    await searches.end("globex", 0)
    assert searches.running == [("acme", 1)]
    await searches.next_phase("acme", 1)
    await searches.end("acme", 1)
    assert (searches.slots.in_use, searches.slots.waiting()) == (0, 0)


async def test_between_phases_the_gate_steps_aside_only_inside_a_search_share() -> None:
    gate = FairShare(FairShareSettings(search_global_concurrency=1), clock=Clock())
    await between_search_phases()  # no share: nothing to do
    boundary, resumed, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def busy_search() -> None:
        async with gate.share("acme", Kind.SEARCH):
            await boundary.wait()
            await between_search_phases()
            resumed.set()

    async def quiet_search() -> None:
        async with gate.share("globex", Kind.SEARCH):
            await release.wait()

    before = stepped_aside("unknown")
    busy = [asyncio.create_task(busy_search()) for _ in range(2)]
    await settle()
    quiet = asyncio.create_task(quiet_search())
    await settle()
    boundary.set()
    await settle()
    assert not resumed.is_set()  # globex's search holds the slot
    release.set()
    await asyncio.gather(quiet, *busy)
    assert stepped_aside("unknown") == before + 1
    assert gate.slots is not None
    assert gate.slots.in_use == 0


async def test_a_search_steps_aside_before_its_embedding_for_a_quieter_tenant() -> None:
    gate = FairShare(FairShareSettings(search_global_concurrency=1), clock=Clock())
    steps: list[str] = []

    class Embedder(HashingEmbedder):
        async def embed(self, texts: Sequence[str]) -> Vectors:
            steps.append("acme embeds")
            return await super().embed(texts)

    class Index(FakeIndex):
        async def candidates(self, request: SearchRequest, vector: Vectors | None) -> Candidates:
            steps.append("acme lists")
            return await super().candidates(request, vector)

    searcher = Searcher(Embedder(DIMENSION), Index())
    go = asyncio.Event()

    async def acme_search() -> None:
        async with gate.share("acme", Kind.SEARCH):
            await go.wait()
            await searcher.search(SearchRequest("acme", "refund", ("p",)))

    async def other_search(tenant: str) -> None:
        async with gate.share(tenant, Kind.SEARCH):
            steps.append(f"{tenant} searches")

    acme = asyncio.create_task(acme_search())
    await settle()
    others = [asyncio.create_task(other_search(t)) for t in ("acme", "globex")]
    await settle()
    go.set()
    await asyncio.gather(acme, *others)
    # globex (one search) before acme's embedding; acme's own next search after its lists.
    assert steps == ["globex searches", "acme embeds", "acme lists", "acme searches"]


def stepped_aside(tier: str) -> float:
    return REGISTRY.get_sample_value("kb_fair_search_stepped_aside_total", {"tier": tier}) or 0.0


# --- the gate: tier, share, slot ----------------------------------------------------------


class Tiers:
    def __init__(self, tiers: dict[str, str]) -> None:
        self.tiers = tiers
        self.reads = 0
        self.fail = False

    async def tier_of(self, tenant_id: str) -> str | None:
        self.reads += 1
        if self.fail:
            raise ConnectionError("database down")
        return self.tiers.get(tenant_id)


async def test_tiers_are_read_once_per_cache_time_and_a_failed_read_is_not_kept() -> None:
    clock = Clock()
    tiers = Tiers({"acme": "free"})
    cached = CachedTiers(tiers, ttl_seconds=60, clock=clock)
    assert [await cached.tier_of("acme") for _ in range(3)] == ["free"] * 3
    assert tiers.reads == 1
    clock.now += 60
    tiers.tiers["acme"] = "premium"
    assert await cached.tier_of("acme") == "premium"
    tiers.fail = True
    clock.now += 60
    assert await cached.tier_of("acme") is None  # the flat limits, and read again next time
    tiers.fail = False
    assert await cached.tier_of("acme") == "premium"
    assert cached.cached() == 1


async def test_a_tier_read_that_hangs_gives_the_flat_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Hanging:
        async def tier_of(self, tenant_id: str) -> str | None:
            await asyncio.Event().wait()  # a pool with every connection busy
            return "free"

    monkeypatch.setattr("services.runtime.fair_share.tiers.READ_TIMEOUT_SECONDS", 0.01)
    assert await CachedTiers(Hanging(), ttl_seconds=60, clock=Clock()).tier_of("acme") is None


async def test_the_gate_applies_the_tenants_tier() -> None:
    settings = FairShareSettings(
        search_concurrency=5,
        search_global_concurrency=0,
        tiers={"free": TierLimits(search_concurrency=1)},
    )
    gate = FairShare(settings, Tiers({"acme": "free", "globex": "premium"}), clock=Clock())

    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(gate.share("acme", Kind.SEARCH))
        with pytest.raises(TenantConcurrencyLimited):
            await held.enter_async_context(gate.share("acme", Kind.SEARCH))
        for _ in range(5):
            await held.enter_async_context(gate.share("globex", Kind.SEARCH))
        with pytest.raises(TenantConcurrencyLimited):
            await held.enter_async_context(gate.share("globex", Kind.SEARCH))
    assert gate.shares.tracked() == 0


async def test_a_search_waiting_for_a_slot_counts_against_its_tenants_cap() -> None:
    settings = FairShareSettings(search_concurrency=3, search_global_concurrency=1)
    gate = FairShare(settings, clock=Clock())
    release = asyncio.Event()

    async def search() -> None:
        async with gate.share("acme", Kind.SEARCH):
            await release.wait()

    tasks = [asyncio.create_task(search()) for _ in range(3)]
    await settle()
    assert gate.slots is not None
    assert gate.slots.waiting("acme") == 2
    with pytest.raises(TenantConcurrencyLimited):
        async with gate.share("acme", Kind.SEARCH):
            pass
    release.set()
    await asyncio.gather(*tasks)
    assert gate.shares.in_flight("acme", Kind.SEARCH) == 0


# --- settings -----------------------------------------------------------------------------


def test_the_limits_of_a_tier_fall_back_to_the_flat_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KB_FAIR_SEARCH_RATE", "20")
    monkeypatch.setenv("KB_FAIR_PUBLISH_CONCURRENCY", "4")
    monkeypatch.setenv(
        "KB_FAIR_TIERS", '{"free": {"search_rate": 2.5, "search_burst": 5}, "premium": {}}'
    )
    settings = FairShareSettings()
    assert settings.limits("free", Kind.SEARCH) == Limits(concurrency=32, rate=2.5, burst=5)
    # No burst given: one second of the rate.
    assert settings.limits("premium", Kind.SEARCH) == Limits(32, 20.0, 20)
    assert settings.limits(None, Kind.PUBLISH) == Limits(4, 0.0, 1)
    assert settings.limits("unknown-tier", Kind.PUBLISH) == Limits(4, 0.0, 1)


def test_the_search_slots_follow_a_cpu_quota_the_affinity_does_not_show(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A pod limited to 2 CPUs on a 16-core node: one search slot, not eight.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("200000 100000\n")
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", tmp_path)
    assert FairShareSettings().search_slots() == 1


def test_the_search_slots_default_to_one_per_two_cpus_of_the_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # No cgroup quota (a folder without cgroup files): the affinity alone counts.
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", tmp_path)
    assert FairShareSettings().search_slots() == max(1, len(os.sched_getaffinity(0)) // 2)
    assert FairShareSettings(search_global_concurrency=0).search_slots() == 0
    assert FairShare(FairShareSettings(search_global_concurrency=0)).slots is None


@pytest.mark.parametrize(
    "tiers",
    [
        '{"Free": {}}',  # not a tier name
        '{"free": {"search_rate": -1}}',
        '{"free": {"search_concurency": 3}}',  # a misspelt field is refused, not ignored
    ],
)
def test_a_bad_tier_setting_is_refused(monkeypatch: pytest.MonkeyPatch, tiers: str) -> None:
    monkeypatch.setenv("KB_FAIR_TIERS", tiers)
    with pytest.raises(ValidationError):
        FairShareSettings()


# --- the routes that take a share ---------------------------------------------------------


def test_every_limited_route_is_a_post_route_of_the_app() -> None:
    app = create_app(
        PublisherSettings(database_url="postgresql://unused/kb"),
        fair_share_settings=FairShareSettings(),
    )
    paths: dict[str, Any] = app.openapi()["paths"]
    for path in FAIR_SHARE_ROUTES:
        assert "post" in paths[path], path
        assert "429" in paths[path]["post"]["responses"], path
    route = LimitedRoute("/v1/tenants/{tenantId}/documents", Kind.PUBLISH)
    assert route.matches("POST", "/v1/tenants/acme/documents")
    assert not route.matches("GET", "/v1/tenants/acme/documents")
    assert not route.matches("POST", "/v1/tenants/acme/documents/bulk")


def test_fair_shares_off_installs_nothing() -> None:
    app = create_app(
        PublisherSettings(database_url="postgresql://unused/kb"),
        fair_share_settings=FairShareSettings(enabled=False),
    )
    assert app.state.fair_share is None
    assert "FairShareMiddleware" not in [m.cls.__name__ for m in app.user_middleware]  # type: ignore[attr-defined]
