"""Search on a streaming replica against search on the primary, and the read-your-switch
token's wait (docs/scaling.md#search-on-replicas).

    kb dev up --replicas 1     # or any primary and a streaming replica of it
    uv run python -m bench.search_replicas \\
        --primary postgresql://postgres@127.0.0.1:25432/kb \\
        --replica postgresql://postgres@127.0.0.1:25442/kb --chunks 20000

Loads the corpus of ``bench/search_scale_corpus.py`` (``--chunks``, clustered vectors) into a
database of its own on the primary (``--reuse``: the one an earlier run loaded) and waits for
the replica to replay it. Then, per layout (search on the primary; search on the replica):

- hybrid searches (``PgSearchIndex.candidates`` + ``rank_results``, the query vector given:
  no embedding) for ``--seconds`` at ``--concurrency``, principals a typical user's: searches/s
  and p50/p95 in milliseconds;
- at the same time, on the primary, ``--writers`` connections committing pointer switches
  (an UPDATE of a document's search pointer each, one transaction) as fast as they can: the
  primary's write commits/s while search runs there or elsewhere (a stand-in for the
  indexers' completions, which are such transactions with chunks in them).

Then the token's wait: ``--switch-rate`` switches/s for ``--switch-seconds`` on the primary,
each followed by its token (the WAL insert position read after the commit, as the status
query reads it) and ``ReplicaRotation.choose(token)``: how long until the replica had
replayed it, p50/p99 (and how many went to the primary after KB_SEARCH_AFTER_WAIT_SECONDS),
with the replica idle and with the search load of the first part running on it.

Primary and replica are wherever the URLs say: on one machine they share its CPUs, so the
replica layout frees nothing there; the figures say what the replica costs and serves.
Needs the servers. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import asyncpg

from bench.databases import url_for
from bench.search_scale_corpus import DIMENSION, build_corpus, build_queries
from bench.search_scale_load import corpus_identity, load, reusable
from bench.search_scale_measure import request_for
from bench.search_scale_timing import percentile
from kbtools.devstack.replicas import caught_up
from services.embedding.onnx_local import MODEL_NAME
from services.runtime.logging import configure_logging
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.replicas import ReplicaRotation
from services.search.searcher import Generation, SearchMode, rank_results
from services.search.statements import SearchSettings

MODEL = MODEL_NAME


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _switch_targets(url: str, count: int) -> list[tuple[str, Any]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT tenant_id, document_id FROM document_search_version LIMIT $1", count
        )
    finally:
        await conn.close()
    return [(r["tenant_id"], r["document_id"]) for r in rows]


SWITCH_SQL = """UPDATE document_search_version SET switched_at = now()
                 WHERE tenant_id = $1 AND document_id = $2"""


async def search_load(
    index: PgSearchIndex, queries: list[Any], concurrency: int, seconds: float
) -> tuple[list[float], float]:
    """Hybrid searches for ``seconds`` at ``concurrency``: each one's milliseconds, and
    searches per second."""
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    turn = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < deadline:
            query = queries[next(turn) % len(queries)]
            request = request_for(query, "typical", SearchMode.HYBRID)
            started = time.perf_counter()
            candidates = await index.candidates(request, query.vector)
            rank_results(request, candidates)
            samples.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, len(samples) / (time.perf_counter() - started)


async def write_load(url: str, writers: int, stop: asyncio.Event) -> tuple[int, float]:
    """Switch commits on the primary by ``writers`` connections until ``stop``."""
    targets = await _switch_targets(url, 1000)
    commits = 0
    started = time.perf_counter()

    async def writer(n: int) -> None:
        nonlocal commits
        conn = await asyncpg.connect(url)
        try:
            i = n
            while not stop.is_set():
                await conn.execute(SWITCH_SQL, *targets[i % len(targets)])
                commits += 1
                i += writers
        finally:
            await conn.close()

    await asyncio.gather(*(writer(n) for n in range(writers)))
    return commits, commits / (time.perf_counter() - started)


async def token_waits(
    primary_url: str,
    rotation: ReplicaRotation,
    rate: float,
    seconds: float,
    synchronous_commit: str,
) -> tuple[list[float], int]:
    """Switches at ``rate``/s; for each, how long until a replica had replayed its token
    (milliseconds), and how many the primary answered after the wait. A switch commits
    with ``synchronous_commit`` (the dev stack's server default is off: its WAL reaches
    the replica only when the WAL writer flushes it, every wal_writer_delay)."""
    targets = await _switch_targets(primary_url, 100)
    conn = await asyncpg.connect(
        primary_url, server_settings={"synchronous_commit": synchronous_commit}
    )
    waits: list[float] = []
    to_primary = 0
    try:
        started = time.perf_counter()
        for n in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, started + n / rate - time.perf_counter()))
            await conn.execute(SWITCH_SQL, *targets[n % len(targets)])
            token = await conn.fetchval(
                "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint"
            )
            target = await rotation.choose(int(token))
            waits.append(target.waited_seconds * 1000)
            to_primary += target.name == "primary"
    finally:
        await conn.close()
    return waits, to_primary


def row(name: str, samples: list[float], per_second: float, extra: str = "") -> str:
    return (
        f"| {name} | {per_second:.1f} | {statistics.median(samples):.2f} | "
        f"{percentile(samples, 0.95):.2f} | {extra} |"
    )


async def run(args: argparse.Namespace) -> int:
    database = args.database or f"kb_bench_replicas_{args.chunks // 1000}k"
    corpus = build_corpus(args.chunks, args.seed, "clustered")
    if args.reuse:
        why = await reusable(args.primary, database, corpus_identity(corpus, MODEL))
        if why is not None:
            print(f"--reuse: {why}; run without --reuse to load it", file=sys.stderr)
            return 2
        primary_url = url_for(args.primary, database)
    else:
        primary_url = await load(
            args.primary,
            database,
            corpus,
            MODEL,
            maintenance_work_mem="256MB",
            parallel_workers=1,
            log=log,
        )
    replica_url = url_for(args.replica, database)
    log("waiting for the replica to replay the corpus")
    await caught_up(primary_url, replica_url, timeout_s=600, poll_s=0.05)
    queries = build_queries(corpus, 200)
    generation = Generation(MODEL, DIMENSION)

    pools = {}
    for layout, url in (("primary", primary_url), ("replica", replica_url)):
        settings = SearchSettings(database_url=url, db_pool_max_size=args.concurrency + 2)
        pools[layout] = (settings, await open_search_pool(settings))
    try:
        print(
            f"{args.chunks} chunks, {len({q.tenant for q in queries})} tenants queried, "
            f"hybrid, typical principals, concurrency {args.concurrency}, "
            f"{args.writers} switch writers on the primary, {args.seconds:.0f} s per row\n"
        )
        print("| search reads | searches/s | p50 ms | p95 ms | primary's switch commits/s |")
        print("|---|---|---|---|---|")
        for layout in ("primary", "replica"):
            settings, pool = pools[layout]
            index = PgSearchIndex(pool, generation, settings)
            await search_load(index, queries, args.concurrency, 2.0)  # warm up
            stop = asyncio.Event()
            writing = asyncio.create_task(write_load(primary_url, args.writers, stop))
            samples, per_second = await search_load(index, queries, args.concurrency, args.seconds)
            stop.set()
            _, commits_per_second = await writing
            print(row(layout, samples, per_second, f"{commits_per_second:.0f}"))
        stop = asyncio.Event()
        writing = asyncio.create_task(write_load(primary_url, args.writers, stop))
        await asyncio.sleep(args.seconds)
        stop.set()
        _, alone = await writing
        print(f"| (no search) | - | - | - | {alone:.0f} |")

        print(
            f"\nToken wait: {args.switch_rate:g} switches/s for {args.switch_seconds:g} s, "
            f"KB_SEARCH_AFTER_WAIT_SECONDS={args.after_wait:g}\n"
        )
        print(
            "| switch's synchronous_commit | replica | switches | wait p50 ms | wait p99 ms "
            "| max ms | to the primary |"
        )
        print("|---|---|---|---|---|---|---|")
        _, replica_pool = pools["replica"]
        _, primary_pool = pools["primary"]
        rotation = ReplicaRotation(
            primary_pool,
            [("replica", replica_pool)],
            max_lag_seconds=60,
            after_wait_seconds=args.after_wait,
            check_seconds=0.5,
        )
        await rotation.check()
        checking_stop = asyncio.Event()
        checking = asyncio.create_task(rotation.run(checking_stop))
        try:
            for commit, label, loaded in (
                (commit, label, loaded)
                for commit in ("off", "on")
                for label, loaded in (("idle", False), ("under the search load", True))
            ):
                load_task = None
                if loaded:
                    settings, pool = pools["replica"]
                    index = PgSearchIndex(pool, generation, settings)
                    load_task = asyncio.create_task(
                        search_load(index, queries, args.concurrency, args.switch_seconds + 1)
                    )
                waits, to_primary = await token_waits(
                    primary_url, rotation, args.switch_rate, args.switch_seconds, commit
                )
                if load_task is not None:
                    await load_task
                print(
                    f"| {commit} | {label} | {len(waits)} | {percentile(waits, 0.5):.2f} | "
                    f"{percentile(waits, 0.99):.2f} | {max(waits):.2f} | {to_primary} |"
                )
        finally:
            checking_stop.set()
            await checking
    finally:
        for _, pool in pools.values():
            await pool.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--primary", required=True, help="admin URL of the primary")
    parser.add_argument("--replica", required=True, help="admin URL of its replica")
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--database", help="default: kb_bench_replicas_<chunks/1000>k")
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--switch-rate", type=float, default=5.0)
    parser.add_argument("--switch-seconds", type=float, default=20.0)
    parser.add_argument("--after-wait", type=float, default=1.0)
    configure_logging("warning", "console", service="bench")  # on stderr, not in the tables
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
