"""Claim -> complete throughput of the kb index task queue vs Procrastinate, same run, same
PostgreSQL server, separate databases, a no-op task on both sides.

    uv run python -m bench.task_queue --tasks 100000 --slots 1 4 16

For each slot count: fresh database, N due tasks spread over --tenants tenants, VACUUM
ANALYZE, then one worker process-equivalent (one asyncio loop, `slots` concurrent tasks)
drains the queue. Reported: tasks/s, claim latency p50/p99 (the claim statement's round
trip as the worker sees it: kb `claim_tasks`, Procrastinate `procrastinate_fetch_job`),
and the queue table's size and dead tuples afterwards. A last kb run repeats the middle
slot count with --finished-backlog SUCCEEDED rows already in the table, to show that
finished tasks do not slow the claim (they are in none of the partial indexes it reads).

Needs DATABASE_URL (or the dev stack, `kb dev up`). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from bench.databases import drop_database, recreate_database
from services.indexer.ports import IndexingOutcome
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import Worker
from services.indexer.task import Lease
from services.runtime.logging import configure_logging
from services.runtime.pg.db import create_pool, skip_session_reset
from services.runtime.pg.migrations import apply_migrations
from services.runtime.settings import RuntimeSettings
from tests.support.tasks import create_many_tasks

KB_DB = "kb_bench_queue"
PROCRASTINATE_DB = "kb_bench_procrastinate"


@dataclass
class Result:
    system: str
    slots: int
    tasks: int
    seconds: float
    claim_ms: list[float] = field(default_factory=list)
    table_bytes: int = 0
    dead_tuples: int = 0
    live_tuples: int = 0
    note: str = ""

    @property
    def per_second(self) -> float:
        return self.tasks / self.seconds

    def percentile(self, q: float) -> float:
        if not self.claim_ms:
            return float("nan")
        ordered = sorted(self.claim_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def table_stats(url: str, *tables: str) -> tuple[int, int, int]:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await asyncio.sleep(1.0)  # let the other backends' statistics arrive
        size = live = dead = 0
        for table in tables:
            size += await conn.fetchval("SELECT pg_total_relation_size($1::regclass)", table)
            row = await conn.fetchrow(
                "SELECT n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE relname = $1",
                table,
            )
            if row is not None:
                live += row["n_live_tup"]
                dead += row["n_dead_tup"]
        return size, live, dead
    finally:
        await conn.close()


# --- kb ----------------------------------------------------------------------------------------


class NoOpIndexer:
    async def index(self, lease: Lease) -> IndexingOutcome:
        return IndexingOutcome()


class TimedQueue(PgTaskQueue):
    """Records each claim's latency and stops the worker once every task is complete."""

    def __init__(self, pool: asyncpg.Pool[Any], expected: int, stop: asyncio.Event) -> None:
        super().__init__(pool)
        self.claim_ms: list[float] = []
        self.completed = 0
        self.expected = expected
        self.stop = stop

    async def claim(
        self, tier: str, owner: str, *, lease_seconds: float, limit: int = 1
    ) -> list[Lease]:
        started = time.perf_counter()
        leases = await super().claim(tier, owner, lease_seconds=lease_seconds, limit=limit)
        if leases:
            self.claim_ms.append((time.perf_counter() - started) * 1000)
        return leases

    async def complete(self, lease: Lease, *, in_transaction: Any = None) -> None:
        await super().complete(lease, in_transaction=in_transaction)
        self.completed += 1
        if self.completed >= self.expected:
            self.stop.set()


async def run_kb(
    admin_url: str, tasks: int, slots: int, tenants: int, finished_backlog: int = 0
) -> Result:
    url = await recreate_database(admin_url, KB_DB)
    conn = await asyncpg.connect(url)
    try:
        await apply_migrations(conn)
        if finished_backlog:
            await create_many_tasks(conn, finished_backlog, tenant_id="old", tier="bench")
            await conn.execute(
                "UPDATE index_task SET status = 'SUCCEEDED', attempts = 1,"
                " finished_at = now() WHERE tenant_id = 'old'"
            )
        per_tenant = tasks // tenants
        for index in range(tenants):
            count = per_tenant if index < tenants - 1 else tasks - per_tenant * (tenants - 1)
            await create_many_tasks(conn, count, tenant_id=f"tenant{index}", tier="bench")
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()

    settings = RuntimeSettings(database_url=url)
    # The pool `kb indexer run` uses: no per-release reset round trip (skip_session_reset in
    # services/runtime/pg/db.py).
    pool = await create_pool(
        settings, min_size=slots + 2, max_size=slots + 2, reset=skip_session_reset
    )
    stop = asyncio.Event()
    queue = TimedQueue(pool, tasks, stop)
    worker = Worker(
        queue,
        NoOpIndexer(),
        tier="bench",
        owner="bench",
        lease_seconds=60,
        concurrency=slots,
        poll_interval_seconds=0.05,
        idle_backoff_min_seconds=0.001,
    )
    try:
        started = time.perf_counter()
        await worker.run(stop)
        elapsed = time.perf_counter() - started
    finally:
        await pool.close()
    size, live, dead = await table_stats(url, "index_task")
    note = f"{finished_backlog} SUCCEEDED rows already in the table" if finished_backlog else ""
    return Result("kb", slots, tasks, elapsed, queue.claim_ms, size, dead, live, note)


# --- Procrastinate -----------------------------------------------------------------------------


async def run_procrastinate(admin_url: str, tasks: int, slots: int) -> Result:
    import procrastinate

    url = await recreate_database(admin_url, PROCRASTINATE_DB)
    claim_ms: list[float] = []

    class TimedConnector(procrastinate.PsycopgConnector):
        async def execute_query_one_async(self, query: str, **arguments: Any) -> Any:
            started = time.perf_counter()
            row = await super().execute_query_one_async(query, **arguments)
            if "procrastinate_fetch_job" in query and row and row.get("id") is not None:
                claim_ms.append((time.perf_counter() - started) * 1000)
            return row

    app = procrastinate.App(
        connector=TimedConnector(conninfo=url, min_size=slots + 2, max_size=slots + 2)
    )

    @app.task(name="noop", queue="bench")
    async def noop(n: int) -> None:
        return None

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        for start in range(0, tasks, 1000):
            batch: list[dict[str, Any]] = [{"n": i} for i in range(start, min(tasks, start + 1000))]
            await noop.batch_defer_async(*batch)
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("VACUUM ANALYZE")
        finally:
            await conn.close()
        started = time.perf_counter()
        await app.run_worker_async(
            queues=["bench"],
            concurrency=slots,
            wait=False,
            listen_notify=False,
            install_signal_handlers=False,
            fetch_job_polling_interval=0.05,
        )
        elapsed = time.perf_counter() - started
    done = await _procrastinate_succeeded(url)
    if done != tasks:
        raise RuntimeError(f"procrastinate finished {done} of {tasks} jobs")
    size, live, dead = await table_stats(url, "procrastinate_jobs", "procrastinate_events")
    return Result(
        "procrastinate",
        slots,
        tasks,
        elapsed,
        claim_ms,
        size,
        dead,
        live,
        "jobs + events tables",
    )


async def _procrastinate_succeeded(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        )
        return count
    finally:
        await conn.close()


# --- report ------------------------------------------------------------------------------------


def table(results: list[Result]) -> str:
    lines = [
        "| system | slots | tasks | seconds | tasks/s | claim p50 ms | claim p99 ms "
        "| table+index size | live tuples | dead tuples | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.system} | {r.slots} | {r.tasks} | {r.seconds:.2f} | {r.per_second:.0f} "
            f"| {r.percentile(0.5):.2f} | {r.percentile(0.99):.2f} "
            f"| {r.table_bytes / 1024 / 1024:.1f} MiB | {r.live_tuples} | {r.dead_tuples} "
            f"| {r.note} |"
        )
    return "\n".join(lines)


def ratios(results: list[Result]) -> str:
    kb = {r.slots: r for r in results if r.system == "kb" and not r.note}
    peer = {r.slots: r for r in results if r.system == "procrastinate"}
    lines = ["| slots | kb tasks/s | procrastinate tasks/s | ratio |", "|---:|---:|---:|---:|"]
    for slots in sorted(kb.keys() & peer.keys()):
        a, b = kb[slots], peer[slots]
        lines.append(
            f"| {slots} | {a.per_second:.0f} | {b.per_second:.0f} "
            f"| {a.per_second / b.per_second:.2f}x |"
        )
    return "\n".join(lines)


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--finished-backlog", type=int, default=100_000)
    parser.add_argument("--skip-procrastinate", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark databases")
    args = parser.parse_args(argv)
    admin_url = os.environ.get("DATABASE_URL") or RuntimeSettings().database_url
    configure_logging("warning", "console", service="bench")

    results: list[Result] = []
    try:
        for slots in args.slots:
            print(f"kb, {slots} slots ...", file=sys.stderr)
            results.append(await run_kb(admin_url, args.tasks, slots, args.tenants))
            if not args.skip_procrastinate:
                print(f"procrastinate, {slots} slots ...", file=sys.stderr)
                results.append(await run_procrastinate(admin_url, args.tasks, slots))
        if args.finished_backlog:
            slots = args.slots[len(args.slots) // 2]
            print(f"kb, {slots} slots, {args.finished_backlog} finished rows ...", file=sys.stderr)
            results.append(
                await run_kb(admin_url, args.tasks, slots, args.tenants, args.finished_backlog)
            )
    finally:
        if not args.keep:
            await drop_database(admin_url, KB_DB)
            await drop_database(admin_url, PROCRASTINATE_DB)
    print(table(results))
    print()
    print(ratios(results))
    print(f"\nclaim latency medians: {statistics.median(results[0].claim_ms):.2f} ms (first run)")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
