"""Progress recorded on one PostgreSQL cluster is never trusted on another: the relay
refuses such a partition (skipping nothing), says so, and picks it up once re-seeded."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from services.relay import metrics
from services.relay.outbox_pg import PgLeaseStore, PgOutboxSource, create_relay_pool
from services.relay.ports import ClusterChanged, Progress
from services.runtime.settings import RuntimeSettings
from tests.support.kafka import (
    TopicReader,
    publish,
    relay_settings,
    relay_topics,
    running_relay,
    wait_for_partitions,
)

pytestmark = pytest.mark.integration


async def _until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    # Metrics are pulled, not pushed: polling them is what a scraper does too.
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def _gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None
    return value


async def _far_ahead(conn: asyncpg.Connection[Any]) -> str:
    """A snapshot as another cluster, further along its own xid history, would store."""
    xmax: int = await conn.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
    ahead = xmax + 1_000_000
    return f"{ahead}:{ahead}:"


@pytest.mark.parametrize("moved", ["counter_behind", "other_identity"])
async def test_progress_from_another_cluster_is_refused_until_reseeded(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any], moved: str
) -> None:
    s = relay_settings(settings, relay_partitions=1)
    metrics.REFUSED_PARTITIONS.set(0)  # process-wide: whatever an earlier test left
    pool = await create_relay_pool(s)
    try:
        await PgLeaseStore(pool).ensure_partitions(1)
    finally:
        await pool.close()
    if moved == "counter_behind":
        await conn.execute(
            "UPDATE relay_partition SET delivered_snapshot = $1::text::pg_snapshot",
            await _far_ahead(conn),
        )
    else:
        await conn.execute("UPDATE relay_partition SET cluster_id = 42")
    stored = [(await publish(conn)).event_id for _ in range(5)]
    async with (
        TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader,
        running_relay(s, owner="relay-a") as relay,
    ):
        # Metrics are pulled, not pushed: wait for the gauge as a scraper would see it.
        await _until(lambda: _gauge("kb_relay_refused_partitions") == 1)
        assert relay.partitions == set()
        row = await conn.fetchrow("SELECT owner, epoch FROM relay_partition")
        assert row is not None
        assert dict(row) == {"owner": None, "epoch": 0}  # never taken
        # The backlog is unknown, not 0.
        assert math.isnan(_gauge("kb_relay_backlog_rows"))
        pool = await create_relay_pool(s)
        try:
            source = PgOutboxSource(pool)
            assert (await source.backlog()).refused_partitions == 1
            future = await conn.fetchval("SELECT now() + interval '30 days'")
            assert await source.delete_delivered(3600, batch=100, now=future) == 0
        finally:
            await pool.close()
        # The operator re-seeds (here: from the start, nothing was delivered yet); the
        # running relay picks the partition up and delivers every row.
        await conn.execute(
            "UPDATE relay_partition SET delivered_snapshot = '1:1:', cluster_id = NULL"
        )
        await wait_for_partitions(relay, 1)
        await reader.read_event_ids(stored)
        await _until(lambda: _gauge("kb_relay_refused_partitions") == 0)
    assert {m.event_id for m in reader.messages} == set(stored)
    recorded = await conn.fetchval("SELECT cluster_id = relay_cluster_id() FROM relay_partition")
    assert recorded is True


async def test_a_relay_whose_database_moved_under_it_writes_no_progress(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    pool = await create_relay_pool(settings)
    try:
        leases = PgLeaseStore(pool)
        source = PgOutboxSource(pool)
        await leases.ensure_partitions(1)
        [lease] = await leases.acquire("relay-a", 1, lease_s=30)
        # A first-time partition records the cluster it runs on.
        assert await conn.fetchval("SELECT cluster_id = relay_cluster_id() FROM relay_partition")
        await publish(conn)
        # Its connections now reach a cluster whose counter is behind its progress: the
        # next window is an error, not "nothing new" (delivered would move backwards).
        ahead = Progress(delivered=await _far_ahead(conn))
        with pytest.raises(ClusterChanged) as raised:
            await source.read_window_batch(lease, ahead, 10)
        assert "kb relay replay" in raised.value.message
        # And the stored progress can neither move backwards...
        await conn.execute(
            "UPDATE relay_partition SET delivered_snapshot = $1::text::pg_snapshot",
            ahead.delivered,
        )
        behind = Progress(delivered=await conn.fetchval("SELECT pg_current_snapshot()::text"))
        with pytest.raises(ClusterChanged):
            await leases.commit_progress(lease, behind, 30)
        # ...nor be written on another cluster.
        await conn.execute(
            "UPDATE relay_partition SET delivered_snapshot = '1:1:', cluster_id = 42"
        )
        with pytest.raises(ClusterChanged):
            await leases.commit_progress(lease, behind, 30)
        assert await conn.fetchval("SELECT delivered_snapshot::text FROM relay_partition") == "1:1:"
        assert [r.partition for r in await leases.refused_partitions()] == [0]
    finally:
        await pool.close()
