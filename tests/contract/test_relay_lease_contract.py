"""One contract, two lease stores: PostgreSQL and the in-memory fake the unit tests use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import asyncpg
import pytest

from services.relay.outbox_pg import PgLeaseStore, create_relay_pool
from services.relay.ports import Lease, Progress
from services.runtime.errors import ConfigError
from services.runtime.settings import RuntimeSettings
from tests.fakes.relay import FakeLeaseStore

# Two snapshots PostgreSQL accepts as text; the fake stores them as they are.
LATER = "100:105:101,103"
LATEST = "200:200:"


class Store(Protocol):
    async def ensure_partitions(self, count: int) -> None: ...

    async def acquire(
        self, owner: str, limit: int, lease_s: float, now: Any = None
    ) -> list[Lease]: ...

    async def renew(self, lease: Lease, lease_s: float, now: Any = None) -> bool: ...

    async def commit_progress(
        self, lease: Lease, progress: Progress, lease_s: float, now: Any = None
    ) -> bool: ...

    async def release(self, lease: Lease, progress: Progress, now: Any = None) -> None: ...


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.integration), "fake"])
def backend(request: pytest.FixtureRequest) -> RuntimeSettings | None:
    """None for the fake; settings naming a fresh migrated database for PostgreSQL (only that
    run needs the servers). A sync fixture, so the session stack starts outside the event
    loop."""
    if request.param == "fake":
        return None
    settings: RuntimeSettings = request.getfixturevalue("settings")
    return settings


@pytest.fixture
async def store(backend: RuntimeSettings | None) -> AsyncIterator[Store]:
    if backend is None:
        yield FakeLeaseStore()
        return
    settings = backend
    pool: asyncpg.Pool[Any] = await create_relay_pool(settings)
    try:
        yield PgLeaseStore(pool)
    finally:
        await pool.close()


T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def test_free_partitions_go_to_the_first_asker_up_to_its_limit(store: Store) -> None:
    await store.ensure_partitions(3)
    first = await store.acquire("a", 2, 10, now=at(0))
    second = await store.acquire("b", 5, 10, now=at(1))
    assert [(x.partition, x.epoch, x.owner) for x in first] == [(0, 1, "a"), (1, 1, "a")]
    assert [(x.partition, x.epoch) for x in second] == [(2, 1)]
    assert await store.acquire("c", 5, 10, now=at(2)) == []
    assert first[0].progress == Progress(delivered="1:1:")


async def test_an_expired_lease_is_taken_over_and_fences_the_old_holder(store: Store) -> None:
    await store.ensure_partitions(1)
    [old] = await store.acquire("a", 1, 10, now=at(0))
    assert await store.renew(old, 10, now=at(5))  # now good until 15
    assert await store.acquire("b", 1, 10, now=at(14)) == []
    [new] = await store.acquire("b", 1, 10, now=at(15))
    assert new.epoch == old.epoch + 1
    assert not await store.renew(old, 10, now=at(16))
    assert not await store.commit_progress(old, Progress(delivered=LATER), 10, now=at(16))
    await store.release(old, Progress(delivered=LATER), now=at(16))  # a no-op for a loser
    assert await store.commit_progress(new, Progress(delivered=LATEST), 10, now=at(16))
    # The loser wrote nothing: the next holder sees the winner's progress.
    await store.release(new, Progress(delivered=LATEST), now=at(17))
    [third] = await store.acquire("c", 1, 10, now=at(17))
    assert third.progress == Progress(delivered=LATEST)


async def test_own_lease_past_its_time_cannot_commit(store: Store) -> None:
    await store.ensure_partitions(1)
    [lease] = await store.acquire("a", 1, 10, now=at(0))
    assert not await store.commit_progress(lease, Progress(delivered=LATER), 10, now=at(10))


async def test_release_records_progress_and_frees_at_once(store: Store) -> None:
    await store.ensure_partitions(2)
    [lease, _] = await store.acquire("a", 2, 60, now=at(0))
    window = Progress(delivered=LATER, window=LATEST, window_position=42)
    assert await store.commit_progress(lease, window, 60, now=at(1))
    await store.release(lease, window, now=at(2))
    [again] = await store.acquire("b", 5, 60, now=at(3))
    assert again.partition == lease.partition
    assert again.progress == window


async def test_the_partition_count_is_fixed(store: Store) -> None:
    await store.ensure_partitions(2)
    await store.ensure_partitions(2)
    with pytest.raises(ConfigError):
        await store.ensure_partitions(3)
