"""Search latency, recall and scale: 100 tenants, realistic ACLs, 100k or 1M chunks.

    uv run python -m bench.search_latency --chunks 100000 --vectors clustered
    uv run python -m bench.search_latency --chunks 1000000 --vectors clustered --load-only
    uv run python -m bench.search_latency --chunks 1000000 --vectors clustered --reuse

A database of its own (default ``kb_bench_scale_<chunks>``, our migrations) holds the
corpus of ``bench/search_scale_corpus.py`` (100 tenants, documents of 4-16 chunks, ACLs of
a few groups each, 1 % of each tenant readable by ``group:narrow``, random or clustered
unit vectors of dimension 384, words drawn from the standard library's docstrings), loaded
by COPY and indexed as ``bench/search_scale_load.py`` says. ``--reuse`` measures a database
an earlier run loaded (same chunks, seed and vectors) instead of loading it again, after
applying the migrations it lacks (a newer checkout's).

    uv run python -m bench.search_latency --chunks 100000 --vectors clustered --reuse --row-security

Measured (``bench/search_scale_measure.py``), the query vector given (the embedding is
timed on its own, with the offline ONNX model), at concurrency 1 and 8:
- ``PgSearchIndex.candidates`` + ``rank_results`` (what ``Searcher.search`` does after
  the embedding) in vector, keyword and hybrid mode, topK 10, for three principal sets of
  the query's tenant: ``group:everyone`` (all of the tenant), a typical user in 3 of 20
  groups (~27 %), and ``group:narrow`` (1 %);
- the same vector and hybrid queries with the vector list as an exact scan (the limit of
  correctness), the same statement with the planner pushed onto the HNSW order
  (``enable_sort = off``: what the ANN path would cost where the planner does not take
  it), and a plain unfiltered pgvector query on the same HNSW index (the limit of speed);
- recall@10 of the vector list against the exact top 10 under the same filter (numpy),
  and whether the answer filled topK (or everything the principal may read, if less);
- ``kb serve`` started as a user starts it, searched over HTTP (the query embedding
  included), and its peak RSS (``bench/search_scale_http.py``).

``--row-security`` measures instead what the tenant wall (KB_DB_ROW_SECURITY,
docs/security.md#the-second-wall) costs the same searches, on and off interleaved
(``bench/search_row_security.py``).

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from bench.databases import url_for
from bench.search_scale_corpus import build_corpus
from bench.search_scale_load import (
    build_tenant_graphs,
    corpus_identity,
    load,
    migrate,
    reusable,
)
from services.embedding.onnx_local import MODEL_NAME

# The offline model's name: `kb serve` with its default embedder searches this index.
MODEL = MODEL_NAME


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> int:
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    database = args.database or f"kb_bench_scale_{args.chunks // 1000}k_{args.vectors}"
    started = time.perf_counter()
    mwm = args.maintenance_work_mem or ("4GB" if args.chunks >= 500_000 else "1GB")
    corpus = build_corpus(args.chunks, args.seed, args.vectors)
    if args.reuse:
        why = await reusable(admin_url, database, corpus_identity(corpus, MODEL))
        if why is not None:
            print(f"--reuse: {why}; run without --reuse to load it", file=sys.stderr)
            return 2
        url = url_for(admin_url, database)
        log(f"reusing {database}")
        for name in await migrate(url):
            log(f"applied migration {name}")
    else:
        url = await load(
            admin_url,
            database,
            corpus,
            MODEL,
            maintenance_work_mem=mwm,
            parallel_workers=args.parallel_workers,
            log=log,
        )
        log(f"{database} loaded and indexed in {time.perf_counter() - started:.0f}s")
    if args.tenant_graph_min_chunks > 0:
        await build_tenant_graphs(
            url,
            MODEL,
            min_chunks=args.tenant_graph_min_chunks,
            maintenance_work_mem=mwm,
            log=log,
        )
    if args.load_only:
        return 0
    if args.row_security:
        from bench.search_row_security import measure_row_security

        await measure_row_security(
            url, corpus, MODEL, args.queries, args.concurrency, prewarmed=args.prewarm, log=log
        )
        return 0
    from bench.search_scale_measure import measure

    await measure(url, corpus, MODEL, args, log=log)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--vectors", choices=["random", "clustered"], default="clustered")
    parser.add_argument("--database", help="default: kb_bench_scale_<chunks/1000>k_<vectors>")
    parser.add_argument("--reuse", action="store_true", help="measure the loaded database")
    parser.add_argument("--load-only", action="store_true", help="load and build, no queries")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--maintenance-work-mem", help="for the index builds (1GB; 4GB at 1M)")
    parser.add_argument("--parallel-workers", type=int, default=2)
    parser.add_argument("--no-http", action="store_true", help="skip the kb serve rows")
    parser.add_argument(
        "--row-security",
        action="store_true",
        help="only the tenant wall's cost: each query with KB_DB_ROW_SECURITY on and off",
    )
    parser.add_argument(
        "--no-prewarm",
        dest="prewarm",
        action="store_false",
        help="measure without reading the tables and indexes into shared_buffers first",
    )
    parser.add_argument(
        "--tenant-graph-min-chunks",
        type=int,
        default=5000,
        help="tenants with at least this many chunks get their own HNSW graph (0: none)",
    )
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
