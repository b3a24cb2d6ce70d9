"""The database's work per document on the indexer's path, statement by statement.

    uv run python -m bench.db_statements --documents 500

``--documents`` one-paragraph notes (``bench.indexing_throughput``'s ``notes`` corpus: one
section, one chunk each) are published, then one `kb indexer run` with default settings
indexes them through the hashing provider (``bench.throughput_provider``), from claim to
completion: claim, load the version, known-chunk reuse, the sink's write, the fenced
completion. The server's ``pg_stat_statements`` (it must be in
``shared_preload_libraries``, with ``pg_stat_statements.track_utility`` on for BEGIN,
COMMIT and COPY) is reset for the bench's database as the indexer starts and read when
every task is done: calls, rows and execution time per document of each statement, the
costliest first, and the totals. The bench's own progress polls are left out.

Execution time is the server's own (``total_exec_time``), so a loaded machine inflates it;
compare runs made one after the other. The dev stack's server does not load the module:
run this against a scratch server of your own (BENCHMARKS.md, "Database CPU per
document") through DATABASE_URL. Uses its own database (``--database``, recreated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import asyncpg

from bench.indexing_throughput import corpus, publish, run_indexer, start_provider
from bench.pipeline import recreate

BENCH_DB = "kb_bench_db_statements"
# The bench's own progress poll (indexing_throughput.progress, run_indexer's span and
# chunk count): not the indexer's work.
OWN_QUERIES = ("count(*) FILTER (WHERE status", "max(finished_at) - min(finished_at)")


async def statements(url: str, documents: int) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            """SELECT s.query, s.calls, s.rows, s.total_exec_time, s.toplevel
                 FROM pg_stat_statements s
                WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                ORDER BY s.total_exec_time DESC"""
        )
    finally:
        await conn.close()
    kept = [row for row in rows if not any(own in row["query"] for own in OWN_QUERIES)]
    per_document = [
        {
            "statement": " ".join(row["query"].split())[:110],
            "calls": row["calls"] / documents,
            "rows": row["rows"] / documents,
            "exec_ms": row["total_exec_time"] / documents,
            # Sent by a client (a round trip), not run inside another (a trigger's, a
            # foreign key's check).
            "toplevel": row["toplevel"],
        }
        for row in kept
    ]
    return {
        "statements_per_document": sum(s["calls"] for s in per_document),
        "sent_per_document": sum(s["calls"] for s in per_document if s["toplevel"]),
        "rows_per_document": sum(s["rows"] for s in per_document),
        "exec_ms_per_document": sum(s["exec_ms"] for s in per_document),
        "transactions_per_document": sum(
            s["calls"] for s in per_document if s["statement"].upper().startswith("COMMIT")
        ),
        "statements": per_document,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit("DATABASE_URL is needed: a server loading pg_stat_statements")
    url = await recreate(admin_url, args.database)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    finally:
        await conn.close()
    documents = corpus("notes", args.documents)
    await publish(url, documents)
    provider, base = start_provider("hashing", 8)
    try:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database"
                " WHERE datname = current_database()), 0)"
            )
        finally:
            await conn.close()
        settings = dict(item.split("=", 1) for item in args.set)
        run = await run_indexer(url, base, len(documents), args.timeout, settings=settings)
    finally:
        provider.terminate()
        provider.wait(timeout=30)
    return {
        "documents": len(documents),
        "settings": settings,
        "docs_per_second": run["succeeded"] / run["seconds"],
        "postgres_cpu_ms_per_document": run["postgres_cpu_ms_per_document"],
        "indexer_cpu_ms_per_document": run["indexer_cpu_ms_per_document"],
        **await statements(url, len(documents)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=500)
    parser.add_argument("--database", default=BENCH_DB)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--top", type=int, default=25, help="statements listed")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KB_NAME=VALUE",
        help="an indexer setting (KB_INDEXER_CONCURRENCY=1: one completion at a time)",
    )
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    result["statements"] = result["statements"][: args.top]
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
