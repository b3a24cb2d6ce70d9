"""The PostgreSQL queue under real concurrency: races, fairness at 10,000-vs-1, takeover,
fenced completion with the sink's writes, HOT heartbeats. (The single-worker behaviour --
expiry, restart with an old generation, exhaustion, retries -- is the contract suite in
tests/contract, run against PostgreSQL too.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.task import TaskStatus
from services.runtime.errors import DatabaseUnavailable, LeaseLost
from services.runtime.messaging.outbox import OutboxEvent, add_event, aggregate_key
from services.runtime.pg.db import create_pool
from services.runtime.settings import RuntimeSettings
from tests.support.clock import ManualClock
from tests.support.tasks import create_many_tasks, create_task

pytestmark = pytest.mark.integration

LEASE = 30.0


@pytest.fixture
async def wide_pool(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    """Enough connections for twenty workers to really run at once."""
    pool = await create_pool(settings, min_size=22, max_size=22)
    try:
        yield pool
    finally:
        await pool.close()


async def _race(queues: list[PgTaskQueue], tier: str = "standard") -> list[Any]:
    start = asyncio.Event()

    async def claimer(index: int, queue: PgTaskQueue) -> list[Any]:
        await start.wait()
        return await queue.claim(tier, f"w{index}", lease_seconds=LEASE)

    racers = [asyncio.create_task(claimer(i, q)) for i, q in enumerate(queues)]
    await asyncio.sleep(0)  # let every racer reach the start line
    start.set()
    results = await asyncio.gather(*racers)
    return [lease for claimed in results for lease in claimed]


@pytest.mark.parametrize("workers", [2, 20])
async def test_workers_racing_for_one_due_task_exactly_one_wins(
    wide_pool: asyncpg.Pool[Any], workers: int
) -> None:
    queues = [PgTaskQueue(wide_pool) for _ in range(workers)]
    for _ in range(5):  # several rounds: a lucky ordering must not hide a double claim
        created = await create_task(wide_pool)
        winners = await _race(queues)
        assert [lease.task_id for lease in winners] == [created.task_id]
        assert winners[0].lease_attempt == 1
        await queues[0].complete(winners[0])


async def test_twenty_workers_racing_for_an_expired_lease_one_takes_it_over(
    wide_pool: asyncpg.Pool[Any],
) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(wide_pool, next_attempt_at=clock.now())
    queues = [PgTaskQueue(wide_pool, clock=clock) for _ in range(20)]
    [first] = await queues[0].claim("standard", "w0", lease_seconds=LEASE)
    clock.advance(LEASE + 1)
    winners = await _race(queues)
    assert len(winners) == 1
    assert winners[0].task_id == created.task_id
    assert winners[0].lease_attempt == first.lease_attempt + 1
    with pytest.raises(LeaseLost):
        await queues[0].heartbeat(first, lease_seconds=LEASE)


async def test_ten_thousand_queued_tasks_do_not_delay_another_tenants_single_task(
    pool: asyncpg.Pool[Any],
) -> None:
    # Every one of the busy tenant's 10,000 tasks is older than the quiet tenant's task.
    await create_many_tasks(pool, 10_000, tenant_id="busy")
    quiet = await create_task(pool, tenant_id="quiet")
    queue = PgTaskQueue(pool)

    # One worker, one slot, each task finished before the next claim: T = 2 tenants with
    # due work, so the quiet task must come within the first round of 2 claims.
    served = []
    for _ in range(2):
        [lease] = await queue.claim("standard", "solo", lease_seconds=LEASE)
        served.append(lease.task_id)
        await queue.complete(lease)
    assert quiet.task_id in served

    # Concurrent workers: while the busy tenant holds slots, a newcomer's task is next.
    newcomer = await create_task(pool, tenant_id="newcomer")
    held = [
        lease for _ in range(3) for lease in await queue.claim("standard", "w", lease_seconds=LEASE)
    ]
    assert newcomer.task_id in {lease.task_id for lease in held}
    remaining = await pool.fetchval(
        "SELECT count(*) FROM index_task WHERE tenant_id = 'busy' AND status = 'PENDING'"
    )
    assert remaining >= 10_000 - 3


async def test_lost_lease_at_completion_writes_neither_task_nor_sink_rows(
    pool: asyncpg.Pool[Any],
) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(pool, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    [old] = await queue.claim("standard", "old", lease_seconds=LEASE)
    clock.advance(LEASE)
    [new] = await queue.claim("standard", "new", lease_seconds=LEASE)

    async def sink(conn: Any) -> None:
        await add_event(
            conn,
            OutboxEvent(
                event_type="DocumentSearchVersionSwitched",
                tenant_id=created.tenant_id,
                tier=created.tier,
                aggregate_key=aggregate_key(created.tenant_id, created.document_id),
                payload=b"\x00",
            ),
        )

    with pytest.raises(LeaseLost):
        await queue.complete(old, in_transaction=sink)
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0

    async def broken_sink(conn: Any) -> None:
        await sink(conn)
        raise RuntimeError("vector write failed")

    with pytest.raises(RuntimeError):
        await queue.complete(new, in_transaction=broken_sink)
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0
    task = await queue.get(created.task_id)
    assert task is not None
    assert task.status is TaskStatus.RUNNING  # rolled back together with the sink's rows

    await queue.complete(new, in_transaction=sink)
    task = await queue.get(created.task_id)
    assert task is not None
    assert task.status is TaskStatus.SUCCEEDED
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 1


async def test_heartbeats_are_hot_updates(settings: RuntimeSettings) -> None:
    pool = await create_pool(settings, min_size=1, max_size=1)
    try:
        created = await create_task(pool)
        queue = PgTaskQueue(pool)
        [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
        await pool.execute("SELECT pg_stat_force_next_flush()")
        before = await _wait_for_updates(pool, 1)  # the claim itself (not HOT) is counted
        # Few enough beats that their row versions fit in the row's page even when page
        # pruning cannot reclaim the dead ones yet (a snapshot held by autovacuum's analyze
        # of the fresh database): a version that does not fit goes to another page, a
        # non-HOT update that says nothing about the heartbeat's columns.
        beats = 20
        for _ in range(beats):
            lease = await queue.heartbeat(lease, lease_seconds=LEASE)
        await pool.execute("SELECT pg_stat_force_next_flush()")
        after = await _wait_for_updates(pool, before[0] + beats)
        assert after[0] - before[0] >= beats
        assert after[1] - before[1] == after[0] - before[0], "a heartbeat was not a HOT update"
        assert (await queue.get(created.task_id)) is not None
    finally:
        await pool.close()


async def _updates(pool: asyncpg.Pool[Any]) -> tuple[int, int]:
    row = await pool.fetchrow(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'index_task'"
    )
    assert row is not None
    return int(row["n_tup_upd"]), int(row["n_tup_hot_upd"])


async def _wait_for_updates(pool: asyncpg.Pool[Any], at_least: int) -> tuple[int, int]:
    # Statistics reach the shared view asynchronously; wait for them, bounded.
    async with asyncio.timeout(10):
        while True:
            seen = await _updates(pool)
            if seen[0] >= at_least:
                return seen
            await pool.execute("SELECT pg_stat_force_next_flush()")
            await asyncio.sleep(0.05)


async def test_claims_only_its_tier(pool: asyncpg.Pool[Any]) -> None:
    await create_task(pool, tenant_id="acme", tier="standard")
    premium = await create_task(pool, tenant_id="globex", tier="premium")
    [lease] = await PgTaskQueue(pool).claim("premium", "w1", lease_seconds=LEASE, limit=10)
    assert lease.task_id == premium.task_id
    assert lease.tier == "premium"
    assert await PgTaskQueue(pool).get(uuid.uuid4()) is None


async def test_heartbeats_use_their_own_pool_and_give_up_within_a_quarter_lease(
    pool: asyncpg.Pool[Any], settings: RuntimeSettings
) -> None:
    await create_task(pool)
    beats = await create_pool(settings, min_size=1, max_size=1)
    try:
        queue = PgTaskQueue(pool, heartbeat_pool=beats)
        [lease] = await queue.claim("standard", "w1", lease_seconds=2.0)
        renewed = await queue.heartbeat(lease, lease_seconds=2.0)
        assert renewed.lease_until > lease.lease_until
        # Its one connection is taken: the heartbeat does not wait for the lease to pass.
        async with beats.acquire():
            with pytest.raises(DatabaseUnavailable):
                await asyncio.wait_for(queue.heartbeat(renewed, lease_seconds=2.0), 1.0)
            # ...while the main pool's work is untouched by it.
            assert await queue.get(lease.task_id) is not None
    finally:
        await beats.close()
