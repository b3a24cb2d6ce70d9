"""What the relay reads to deliver a long transaction's rows once it commits.

    uv run python -m bench.relay_drain --rows 20000 --partitions 4

A transaction T inserts one outbox row and stays open while --rows rows commit (in
transactions of 100) and are drained by every partition. Then T commits and every
partition drains again, its window holding T's row and 10 rows committed after T.
Figures: outbox rows the drain fetched from the heap (pg_stat_user_tables idx_tup_fetch +
seq_tup_read, flushed by the reading backend) per row delivered, for the drain while T
was open and for the drain after T committed, and the wall time of each. Drives
``PgOutboxSource`` directly (no Kafka): what is measured is the reading. Needs
DATABASE_URL; creates and drops a database of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import asyncpg

from bench.databases import recreate_database
from services.relay.outbox_pg import PgLeaseStore, PgOutboxSource, create_relay_pool
from services.relay.ports import Lease
from services.relay.settings import RelaySettings
from services.runtime.logging import configure_logging
from services.runtime.messaging.outbox import OutboxEvent, add_event, aggregate_key
from services.runtime.settings import RuntimeSettings

BENCH_DB = "kb_bench_relay_drain"


@dataclass(frozen=True)
class Drain:
    delivered: int
    fetched: int
    seconds: float

    @property
    def fetched_per_delivered(self) -> float:
        return self.fetched / max(1, self.delivered)


async def _database(admin_url: str) -> str:
    return await recreate_database(admin_url, BENCH_DB, migrate=True)


def _event(document: str) -> OutboxEvent:
    return OutboxEvent(
        event_type="DocumentPublished",
        tenant_id="acme",
        tier="standard",
        aggregate_key=aggregate_key("acme", document),
        payload=b"x" * 200,
    )


async def _fetched(observer: asyncpg.Connection[Any]) -> int:
    await observer.execute("SELECT pg_stat_clear_snapshot()")
    value: int = await observer.fetchval(
        "SELECT coalesce(idx_tup_fetch, 0) + seq_tup_read FROM pg_stat_user_tables"
        " WHERE relname = 'outbox'"
    )
    return value


async def _drain(
    pool: asyncpg.Pool[Any],
    source: PgOutboxSource,
    leases: list[Lease],
    observer: asyncpg.Connection[Any],
    batch: int,
) -> tuple[Drain, list[Lease]]:
    before = await _fetched(observer)
    started = time.perf_counter()
    delivered = 0
    drained: list[Lease] = []
    for lease in leases:
        progress = lease.progress
        while True:
            read = await source.read_window_batch(lease, progress, batch)
            delivered += len(read.records)
            progress = read.following
            if progress.window is None and not read.records:
                break
        drained.append(
            Lease(lease.partition, lease.partition_count, lease.owner, lease.epoch, progress)
        )
    seconds = time.perf_counter() - started
    # The reading backend reports its counters when idle; make it report now.
    await pool.execute("SELECT pg_stat_force_next_flush()")
    await pool.execute("SELECT 1")
    return Drain(delivered, await _fetched(observer) - before, seconds), drained


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()
    configure_logging("warning", "console")
    admin_url = os.environ.get("DATABASE_URL", RuntimeSettings().database_url)
    url = await _database(admin_url)
    settings = RelaySettings(database_url=url, relay_partitions=args.partitions)
    # One reading backend, so its statistics can be flushed on demand.
    pool = await create_relay_pool(settings, min_size=1, max_size=1)
    observer = await asyncpg.connect(url)
    long_open = await asyncpg.connect(url)
    writer = await asyncpg.connect(url)
    try:
        store = PgLeaseStore(pool)
        await store.ensure_partitions(args.partitions)
        leases = await store.acquire("bench", args.partitions, 3600)
        source = PgOutboxSource(pool)
        transaction = long_open.transaction()
        await transaction.start()
        # Its own document: add_event makes writers of one document wait for each other.
        await add_event(long_open, _event("held-open"))
        for start in range(0, args.rows, 100):
            async with writer.transaction():
                for i in range(start, min(args.rows, start + 100)):
                    await add_event(writer, _event(f"doc-{i % 997}"))
        while_open, leases = await _drain(pool, source, leases, observer, args.batch_size)
        await transaction.commit()
        # Rows keep coming: the next window holds T's row and these.
        async with writer.transaction():
            for i in range(args.rows, args.rows + 10):
                await add_event(writer, _event(f"doc-{i % 997}"))
        after_commit, leases = await _drain(pool, source, leases, observer, args.batch_size)
        print(
            f"{args.rows} rows committed behind one open transaction, {args.partitions} partitions"
        )
        for name, drain in (("while open", while_open), ("after its commit", after_commit)):
            print(
                f"  drain {name:17} delivered {drain.delivered:6d}  fetched {drain.fetched:7d}"
                f"  fetched/delivered {drain.fetched_per_delivered:9.2f}"
                f"  {drain.seconds * 1000:8.1f} ms"
            )
    finally:
        for conn in (observer, long_open, writer):
            await conn.close()
        await pool.close()
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{BENCH_DB}" WITH (FORCE)')
        finally:
            await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
