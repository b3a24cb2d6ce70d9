"""Keyword and hybrid search before and after the bounded keyword list, interleaved in one run.

    uv run python -m bench.search_scale_single --chunks 100000 --vectors clustered   # the corpus
    uv run python -m bench.keyword_ab --database kb_bench_search [--queries 200] [--caps 1000,250]

Reads the corpus bench.search_scale_single left in ``--database`` (one tenant, 100,000 chunks of
Zipf-drawn words). "before" is search.sql as of ``--before`` (git), run with that version's
parameters in the same kind of read-only transaction; "after" is ``PgSearchIndex`` as it is.
Each query runs before, after and as the plain unfiltered pgvector query, one after another
on one pool, so load on a shared machine hits all three alike; reported: p50/p95 and p50
against the plain query. Query sets: two random vocabulary words (bench.search_scale_single's),
the two commonest words (every chunk matches: the worst case), and natural questions (six
vocabulary words among "how do I ... the ... for ..."). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bench.databases import url_for
from bench.search_scale_single import (
    CLUSTERS,
    DIMENSION,
    MODEL,
    TENANT,
    VOCABULARY,
    percentile,
    unit_vectors,
)
from services.index.ann import model_predicate, vector_expression
from services.runtime.pg.db import create_pool
from services.runtime.pg.sql import parse_queries
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import TEMPLATE_DIMENSION, TEMPLATE_MODEL, SearchSettings

BEFORE = "b288e85"  # main before the bounded keyword list


def old_sql(commit: str) -> tuple[str, str]:
    text = subprocess.run(
        ["git", "show", f"{commit}:services/search/search.sql"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    queries = parse_queries(text)
    sql = queries["search_candidates"]
    sql = sql.replace(
        vector_expression(TEMPLATE_DIMENSION, "c.embedding"),
        vector_expression(DIMENSION, "c.embedding"),
    )
    for alias in ("s", "c"):
        sql = sql.replace(
            model_predicate(TEMPLATE_MODEL, f"{alias}.embedding_model"),
            model_predicate(MODEL, f"{alias}.embedding_model"),
        )
    return queries["configure_search_transaction"], sql


def query_sets(rng: np.random.Generator, n: int) -> dict[str, list[str]]:
    fillers = ["how do i", "what is the", "can i get a", "where do we find the"]
    natural = []
    for _ in range(n):
        words = rng.choice(VOCABULARY, size=6)
        natural.append(
            f"{rng.choice(fillers)} {words[0]} {words[1]} for the {words[2]} "
            f"{words[3]} of my {words[4]} {words[5]}"
        )
    return {
        "two words": [" ".join(rng.choice(VOCABULARY, size=2)) for _ in range(n)],
        "two commonest words": [f"{VOCABULARY[0]} {VOCABULARY[-1]}"] * n,
        "natural question": natural,
    }


async def run(args: argparse.Namespace) -> None:
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    url = url_for(admin_url, args.database)
    settings = SearchSettings(database_url=url, db_pool_min_size=1, db_pool_max_size=2)
    pool = await create_pool(settings)
    configure, before_sql = old_sql(args.before)
    rng = np.random.default_rng(args.seed)
    centroids = unit_vectors(rng, CLUSTERS, None)
    vectors = unit_vectors(rng, args.queries, centroids)
    plain_sql = (
        "SELECT chunk_id FROM knowledge_chunk c"
        f" WHERE {model_predicate(MODEL, 'c.embedding_model')}"
        f" ORDER BY {vector_expression(DIMENSION, 'c.embedding')} <=> $1::vector LIMIT 10"
    )

    async def plain(n: int, text: str) -> Any:
        async with pool.acquire() as conn, conn.transaction(readonly=True):
            await conn.execute(
                "SELECT set_config('hnsw.ef_search', $1, true)", str(settings.search_ef_search)
            )
            return await conn.fetch(plain_sql, vectors[n])

    def before(mode: SearchMode) -> Callable[[int, str], Awaitable[Any]]:
        async def call(n: int, text: str) -> Any:
            request = SearchRequest(TENANT, text, (args.principal,), top_k=10, mode=mode)
            async with pool.acquire() as conn, conn.transaction(readonly=True):
                await conn.execute(configure, max(settings.search_ef_search, request.depth), 20_000)
                return await conn.fetch(
                    before_sql,
                    TENANT,
                    [args.principal],
                    vectors[n] if mode.uses_vector else None,
                    request.depth,
                    None,
                    None,
                    mode.uses_vector,
                    mode.uses_keyword,
                    text,
                )

        return call

    def after(mode: SearchMode, index: PgSearchIndex) -> Callable[[int, str], Awaitable[Any]]:
        async def call(n: int, text: str) -> Any:
            request = SearchRequest(TENANT, text, (args.principal,), top_k=10, mode=mode)
            return await index.candidates(request, vectors[n] if mode.uses_vector else None)

        return call

    indexes = {
        cap: PgSearchIndex(
            pool,
            Generation(MODEL, DIMENSION),
            settings.model_copy(update={"search_keyword_candidates": cap}),
        )
        for cap in args.caps
    }
    print(
        f"{args.queries} queries per set, database {args.database}, before = {args.before},"
        f" principal {args.principal}"
    )
    print()
    print("| queries | mode | variant | p50 ms | p95 ms | p50 vs plain | p95 vs plain |")
    print("|---|---|---|---:|---:|---:|---:|")
    try:
        for name, texts in query_sets(rng, args.queries).items():
            if args.sets and name not in args.sets:
                continue
            for mode in args.modes:
                calls = {"before": before(mode)}
                for cap, index in indexes.items():
                    calls[f"after, cap {cap}"] = after(mode, index)
                calls["plain pgvector"] = plain
                samples: dict[str, list[float]] = {k: [] for k in calls}
                for n in range(min(10, args.queries)):  # warm-up
                    for call in calls.values():
                        await call(n, texts[n])
                for n, text in enumerate(texts):
                    for key, call in calls.items():
                        started = time.perf_counter()
                        await call(n, text)
                        samples[key].append((time.perf_counter() - started) * 1000)
                plain_p50 = statistics.median(samples["plain pgvector"])
                plain_p95 = percentile(samples["plain pgvector"], 0.95)
                for key, values in samples.items():
                    p50, p95 = statistics.median(values), percentile(values, 0.95)
                    print(
                        f"| {name} | {mode.value} | {key} | {p50:.2f} | {p95:.2f} |"
                        f" {p50 / plain_p50:.2f}x | {p95 / plain_p95:.2f}x |"
                    )
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default="kb_bench_search")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument(
        "--caps",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[1000],
        help="KB_SEARCH_KEYWORD_CANDIDATES values to run 'after' with, e.g. 1000,250",
    )
    parser.add_argument("--principal", default="group:all", help="or group:few (2%% readable)")
    parser.add_argument(
        "--modes",
        type=lambda text: [SearchMode(m) for m in text.split(",")],
        default=[SearchMode.KEYWORD, SearchMode.HYBRID],
        help="e.g. vector,keyword,hybrid",
    )
    parser.add_argument(
        "--sets",
        type=lambda text: text.split(","),
        default=None,
        help="query sets to run (default all), e.g. 'two words,natural question'",
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
