"""Ingest keys kept a short while (docs/security.md#publish-by-event): read once per run for
those not kept, a revoked key accepted at most ``KB_INGEST_KEY_CACHE_SECONDS`` after its
revocation, a key not found never kept (one just registered works at once)."""

from __future__ import annotations

from services.publisher.ingest.key_cache import KeyCache
from services.publisher.ingest.signing import IngestKey

K1 = IngestKey("k1", b"\x01" * 32)
K2 = IngestKey("k2", b"\x02" * 32)


class Registry:
    def __init__(self, *keys: IngestKey) -> None:
        self.live = {key.key_id: key for key in keys}
        self.reads: list[list[str]] = []

    async def lookup(self, tenant_id: str, key_ids: list[str]) -> dict[str, IngestKey]:
        self.reads.append(key_ids)
        return {k: self.live[k] for k in key_ids if k in self.live}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_runs_keys_are_read_at_once_and_then_kept() -> None:
    registry, clock = Registry(K1, K2), Clock()
    cache = KeyCache(registry.lookup, 10, clock)
    assert await cache.keys("acme", ["k1", "k2", "k1", ""]) == {"k1": K1, "k2": K2}
    assert await cache.keys("acme", ["k2", "k1"]) == {"k1": K1, "k2": K2}
    assert registry.reads == [["k1", "k2"]]


async def test_a_revoked_key_is_refused_once_its_time_is_up() -> None:
    registry, clock = Registry(K1), Clock()
    cache = KeyCache(registry.lookup, 10, clock)
    assert await cache.keys("acme", ["k1"]) == {"k1": K1}
    del registry.live["k1"]  # revoked
    clock.now += 9.9
    assert await cache.keys("acme", ["k1"]) == {"k1": K1}  # within the bound
    clock.now += 0.1
    assert await cache.keys("acme", ["k1"]) == {}
    assert await cache.keys("acme", ["k1"]) == {}


async def test_a_key_not_found_is_not_kept_and_tenants_do_not_share_keys() -> None:
    registry, clock = Registry(), Clock()
    cache = KeyCache(registry.lookup, 10, clock)
    assert await cache.keys("acme", ["k1"]) == {}
    registry.live["k1"] = K1  # registered now
    assert await cache.keys("acme", ["k1"]) == {"k1": K1}
    registry.reads.clear()
    await cache.keys("beta", ["k1"])
    assert registry.reads == [["k1"]]


async def test_no_cache_reads_every_time() -> None:
    registry = Registry(K1)
    cache = KeyCache(registry.lookup, 0, Clock())
    await cache.keys("acme", ["k1"])
    await cache.keys("acme", ["k1"])
    assert len(registry.reads) == 2


async def test_the_cache_holds_at_most_its_bound_the_least_recently_used_out_first() -> None:
    registry, clock = Registry(K1), Clock()
    cache = KeyCache(registry.lookup, 10, clock, max_entries=5)
    await cache.keys("tenant-0", ["k1"])
    for n in range(1, 50):  # ten times the bound, tenant-0 used again all along
        await cache.keys(f"tenant-{n}", ["k1"])
        await cache.keys("tenant-0", ["k1"])
        assert len(cache) <= 5
    assert len(cache) == 5
    registry.reads.clear()
    await cache.keys("tenant-0", ["k1"])  # used the most: kept
    await cache.keys("tenant-49", ["k1"])
    assert registry.reads == []
    await cache.keys("tenant-1", ["k1"])  # among the first out
    assert registry.reads == [["k1"]]


async def test_an_expired_entry_is_gone_after_a_sweep() -> None:
    registry, clock = Registry(K1, K2), Clock()
    cache = KeyCache(registry.lookup, 10, clock)
    await cache.keys("acme", ["k1"])
    clock.now += 5
    await cache.keys("beta", ["k2"])
    clock.now += 5  # acme's is 10 seconds old, beta's 5
    cache.sweep()
    assert len(cache) == 1
    registry.reads.clear()
    await cache.keys("beta", ["k2"])
    assert registry.reads == []


async def test_a_tenant_seen_once_does_not_stay_once_its_time_is_up() -> None:
    registry, clock = Registry(K1), Clock()
    cache = KeyCache(registry.lookup, 10, clock)
    await cache.keys("acme", ["k1"])
    clock.now += 10
    await cache.keys("beta", ["k1"])  # the sweep rides on a later call, once per period
    assert len(cache) == 1
