"""What the tenant wall costs search (``bench.search_latency --row-security``): the same
queries through ``PgSearchIndex`` with ``KB_DB_ROW_SECURITY`` on (the search's transaction
as kb_tenant_api, the tenant set: migrations/0029) and off (as the connecting role), in the
same run, interleaved query by query (``search_scale_timing.timed``'s peer: each worker
runs a query on one side and at once on the other, alternating which goes first, so the
machine's drift and the CPU caches fall on both alike). Each side has a pool of its own:
the plans of one role are never re-checked for the other. Printed as a Markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.search_scale_corpus import DIMENSION, PRINCIPAL_CLASSES, Corpus, build_queries
from bench.search_scale_load import STRATEGY
from bench.search_scale_measure import prewarm, prime_paths, request_for
from bench.search_scale_timing import TOP_K, percentile, timed
from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.runtime.tenancy.tenant_wall import full_text_match_is_leakproof
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, rank_results
from services.search.statements import SearchSettings

MODES = (SearchMode.VECTOR, SearchMode.KEYWORD, SearchMode.HYBRID)


async def measure_row_security(
    url: str,
    corpus: Corpus,
    model: str,
    queries_per_row: int,
    concurrency: list[int],
    *,
    prewarmed: bool,
    log: Callable[[str], None],
) -> None:
    queries = build_queries(corpus, queries_per_row)
    size = max(concurrency)
    # Hybrid reads its second list on a second connection when one is idle.
    settings = SearchSettings(database_url=url, db_pool_min_size=size, db_pool_max_size=2 * size)
    pools = {wall: await open_search_pool(settings) for wall in (True, False)}
    rows: list[tuple[str, str, int, list[float], list[float]]] = []
    try:
        # What the cost depends on (services/runtime/tenancy/tenant_wall.py): the full-text match
        # LEAKPROOF or not in this database.
        leakproof = await full_text_match_is_leakproof(pools[False])
        if prewarmed:
            log(f"prewarmed {await prewarm(pools[True])} blocks")
        await PgVectorSink(pools[False], partition_graphs=True).ensure_generation(
            IndexGeneration(model, DIMENSION, STRATEGY)
        )
        generation = Generation(model, DIMENSION)
        indexes = {
            wall: PgSearchIndex(
                pools[wall],
                generation,
                settings.model_copy(update={"db_row_security": "on" if wall else "off"}),
            )
            for wall in (True, False)
        }
        for principal_class in PRINCIPAL_CLASSES:
            for mode in MODES:
                for wall, index in indexes.items():
                    await prime_paths(pools[wall], index, queries, principal_class, mode)

                def side(
                    wall: bool, mode: SearchMode = mode, principals: str = principal_class
                ) -> Callable[[int], Any]:
                    index = indexes[wall]

                    async def call(n: int) -> Any:
                        request = request_for(queries[n], principals, mode)
                        candidates = await index.candidates(
                            request, queries[n].vector if mode.uses_vector else None
                        )
                        return rank_results(request, candidates)

                    return call

                for c in concurrency:
                    on, answers, _, off = await timed(side(True), len(queries), c, peer=side(False))
                    if not any(answers):
                        raise RuntimeError(f"{mode.value} {principal_class}: no answer at all")
                    rows.append((mode.value, principal_class, c, on, off))
                    log(
                        f"{mode.value} {principal_class} c{c}: p95 on"
                        f" {percentile(on, 0.95):.2f} ms, off {percentile(off, 0.95):.2f} ms"
                    )
        for index in indexes.values():
            await index.ended()
    finally:
        for pool in pools.values():
            await pool.close()
    _report(corpus, queries_per_row, leakproof, rows)


def _report(
    corpus: Corpus,
    queries: int,
    leakproof: bool,
    rows: list[tuple[str, str, int, list[float], list[float]]],
) -> None:
    print(
        f"Tenant wall (KB_DB_ROW_SECURITY) on vs off: {corpus.chunks:,} chunks, 100 tenants,"
        f" {queries} queries per row, topK {TOP_K}, each query on both sides in turn;"
        f" ts_match_vq {'LEAKPROOF' if leakproof else 'not LEAKPROOF'}."
    )
    print()
    print("| mode | principals | conc. | p50 on | p50 off | p95 on | p95 off | p95 on/off |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for mode, principals, c, on, off in rows:
        ratio = percentile(on, 0.95) / percentile(off, 0.95)
        ratios.append(ratio)
        print(
            f"| {mode} | {principals} | {c} | {statistics.median(on):.2f}"
            f" | {statistics.median(off):.2f} | {percentile(on, 0.95):.2f}"
            f" | {percentile(off, 0.95):.2f} | {ratio:.3f} |"
        )
    print()
    print(
        f"p95 on/off over the rows: geometric mean {statistics.geometric_mean(ratios):.3f},"
        f" median {statistics.median(ratios):.3f}, max {max(ratios):.3f}."
    )
