"""The keyword list's word statistics: a tenant's own sample against its partition's ANALYZE
statistics, for cost and for how well each tells common words from rare ones.

    uv run python -m bench.search_scale_single --chunks 100000 --queries 10   # the corpus
    uv run python -m bench.word_statistics --database kb_bench_search [--rounds 15]

Reads the corpus bench.search_scale_single left in ``--database`` (one tenant, Zipf-drawn
words). Measured in one run, one connection, one read after the other so that load on a
shared machine hits all alike:
- the partition's statistics read (the query search.sql used before: pg_stats of the
  tenant's partition), and the tenant's sample (tenant_common_lexemes) at each
  ``--samples`` size, p50 over ``--rounds`` reads;
- a keyword search (``PgSearchIndex.candidates``, statistics cached), p50: what the read
  costs against the search that pays for it once per KB_SEARCH_STATISTICS_CACHE_SECONDS;
- against the exact counts (ts_stat over every chunk of the tenant): of the vocabulary's
  words, the share each source puts on the right side of the keyword cap (common: in more
  than ``--cap`` chunks), and the estimate of the tenant's chunks.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from bench.databases import url_for
from bench.search_scale_single import DIMENSION, MODEL, TENANT, VOCABULARY
from services.runtime.pg.db import create_pool
from services.search.index_pg import PgSearchIndex, read_word_sample
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings

# search.sql's partition_common_lexemes, as it was before the tenant's own sample.
PARTITION_STATISTICS = """
SELECT e.lexeme, e.fraction * greatest(c.reltuples, 0) AS estimated_chunks
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_stats s
    ON s.schemaname = n.nspname AND s.tablename = c.relname
   AND s.attname = 'search_document' AND NOT s.inherited
 CROSS JOIN LATERAL unnest(s.most_common_elems::text::text[], s.most_common_elem_freqs)
            AS e(lexeme, fraction)
 WHERE c.oid = (SELECT k.tableoid FROM knowledge_chunk k WHERE k.tenant_id = $1 LIMIT 1)
   AND e.lexeme IS NOT NULL
"""
EXACT = """
SELECT word, ndoc FROM ts_stat(format(
    'SELECT search_document FROM knowledge_chunk WHERE tenant_id = %L', $1::text))
"""


async def p50_ms(rounds: int, call: Callable[[], Awaitable[Any]]) -> float:
    await call()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def agreement(estimate: Mapping[str, float], exact: Mapping[str, float], cap: int) -> float:
    words = [w for w in dict.fromkeys(VOCABULARY) if w in exact]
    same = sum((estimate.get(w, 0.0) > cap) == (exact[w] > cap) for w in words)
    return same / len(words)


async def run(args: argparse.Namespace) -> None:
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    settings = SearchSettings(
        database_url=url_for(admin_url, args.database), db_pool_min_size=1, db_pool_max_size=2
    )
    pool = await create_pool(settings)
    index = PgSearchIndex(pool, Generation(MODEL, DIMENSION), settings)
    try:
        async with pool.acquire() as conn:
            chunks = await conn.fetchval(
                "SELECT count(*) FROM knowledge_chunk WHERE tenant_id = $1", TENANT
            )
            exact = {r["word"]: float(r["ndoc"]) for r in await conn.fetch(EXACT, TENANT)}
            partition = {
                r["lexeme"]: float(r["estimated_chunks"])
                for r in await conn.fetch(PARTITION_STATISTICS, TENANT)
            }
            rows: list[tuple[str, float, float, float]] = []
            rows.append(
                (
                    "partition statistics (ANALYZE)",
                    await p50_ms(args.rounds, lambda: conn.fetch(PARTITION_STATISTICS, TENANT)),
                    agreement(partition, exact, args.cap),
                    float("nan"),
                )
            )
            for size in args.samples:
                sized = settings.model_copy(update={"search_statistics_sample_chunks": size})
                sample = await read_word_sample(conn, TENANT, MODEL, sized)

                async def read(sized: SearchSettings = sized) -> Any:
                    return await read_word_sample(conn, TENANT, MODEL, sized)

                rows.append(
                    (
                        f"tenant sample, {size} chunks",
                        await p50_ms(args.rounds, read),
                        agreement(sample.common_lexemes(), exact, args.cap),
                        sample.tenant_chunks(),
                    )
                )

        async def keyword_search() -> Any:
            question = f"how do i {VOCABULARY[3]} the {VOCABULARY[40]} for {VOCABULARY[-5]}"
            request = SearchRequest(TENANT, question, ("group:all",), mode=SearchMode.KEYWORD)
            return await index.candidates(request, None)

        search_p50 = await p50_ms(args.rounds, keyword_search)
    finally:
        await pool.close()
    print(
        f"database {args.database}: {chunks} chunks of one tenant, cap {args.cap},"
        f" {args.rounds} rounds; a keyword search (statistics cached) p50 {search_p50:.1f} ms"
    )
    print()
    print(
        "| statistics | read p50 ms | read vs keyword search | words on the right side "
        "of the cap | tenant's chunks estimated |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, read_ms, right, estimated in rows:
        shown = "—" if estimated != estimated else f"{estimated:,.0f}"
        print(f"| {name} | {read_ms:.1f} | {read_ms / search_p50:.1f}x | {right:.1%} | {shown} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default="kb_bench_search")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cap", type=int, default=250)
    parser.add_argument(
        "--samples",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1000, 2000, 5000],
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
