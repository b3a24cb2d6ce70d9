"""The measurements of ``bench.search_latency`` on a loaded database: search through
``PgSearchIndex`` at concurrency 1 and 8, its exact-scan twin, the plain pgvector query,
recall and topK fill against numpy, the query embedding of the ONNX model, the HTTP rows
of ``kb serve``; printed as Markdown tables on stdout."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.search_scale_corpus import (
    DIMENSION,
    PRINCIPAL_CLASSES,
    Array,
    Corpus,
    Query,
    all_vectors,
    build_queries,
    exact_top,
    tenant_name,
)
from bench.search_scale_http import http_measure
from bench.search_scale_load import EXACT_INDEX, STRATEGY, meta
from bench.search_scale_timing import TOP_K, Row, percentile, timed
from services.index.ann import (
    ann_index_name,
    model_predicate,
    tenant_ann_index_name,
    vector_expression,
)
from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.searcher import (
    Candidates,
    Generation,
    SearchHit,
    SearchMode,
    SearchRequest,
    rank_results,
)
from services.search.statements import SearchSettings, VectorPath

PLAIN_TENANT = "plain pgvector, tenant only"
COMMON_WORD_QUERIES = 50


def index_on_path(
    pool: Any, generation: Generation, settings: SearchSettings, path: VectorPath
) -> PgSearchIndex:
    """Search whose vector list always takes ``path``: EXACT ranks every chunk that passes
    the filters (the limit of correctness); ANN always walks the tenant partition's graph."""
    threshold = 0 if path is VectorPath.ANN else 10_000_000
    return PgSearchIndex(
        pool, generation, settings.model_copy(update={"search_exact_max_chunks": threshold})
    )


async def prime_paths(
    pool: Any,
    index: PgSearchIndex,
    queries: list[Query],
    principal_class: str,
    mode: SearchMode,
) -> None:
    """Has ``index`` keep each query's principals' vector path, as their earlier search
    would have (KB_SEARCH_PATH_CACHE_SECONDS), without running the query itself (whose
    pages would then be warm)."""
    async with pool.acquire() as conn:
        for query in queries:
            async with conn.transaction(readonly=True, isolation="repeatable_read"):
                await index.vector_path(conn, request_for(query, principal_class, mode))


def request_for(
    query: Query, principal_class: str, mode: SearchMode, *, common: bool = False
) -> SearchRequest:
    text = query.common if common else query.text
    return SearchRequest(
        tenant_name(query.tenant), text, query.principals(principal_class), TOP_K, mode
    )


def variants(
    index: PgSearchIndex,
    exact_index: PgSearchIndex,
    forced_index: PgSearchIndex,
    counting_index: PgSearchIndex,
    concurrency: list[int],
    queries: int,
) -> list[tuple[str, SearchMode, PgSearchIndex, list[int], int, bool]]:
    """(row name, mode, index, concurrency levels, queries, one common word only).

    ``index``'s rows are searches by principals who searched a moment ago (their path is
    kept: ``prime_paths``); ``counting_index``'s are first searches (counted)."""
    return [
        ("search vector", SearchMode.VECTOR, index, concurrency, queries, False),
        # A principal set's first search (or one past KB_SEARCH_PATH_CACHE_SECONDS): the path
        # is counted before the vector list.
        ("search vector, path counted", SearchMode.VECTOR, counting_index, [1], queries, False),
        ("exact scan vector", SearchMode.VECTOR, exact_index, [1], queries, False),
        (
            "search vector, ANN path forced",
            SearchMode.VECTOR,
            forced_index,
            concurrency,
            queries,
            False,
        ),
        ("search keyword", SearchMode.KEYWORD, index, concurrency, queries, False),
        # The keyword side's worst case: every chunk holding a common word is ranked.
        (
            "search keyword, one common word",
            SearchMode.KEYWORD,
            index,
            concurrency,
            min(queries, COMMON_WORD_QUERIES),
            True,
        ),
        ("search hybrid", SearchMode.HYBRID, index, concurrency, queries, False),
        ("search hybrid, path counted", SearchMode.HYBRID, counting_index, [1], queries, False),
        ("exact scan hybrid", SearchMode.HYBRID, exact_index, [1], queries, False),
        (
            "search hybrid, ANN path forced",
            SearchMode.HYBRID,
            forced_index,
            concurrency,
            queries,
            False,
        ),
    ]


async def measure(
    url: str,
    corpus: Corpus,
    model: str,
    args: argparse.Namespace,
    *,
    log: Callable[[str], None],
) -> None:
    queries = build_queries(corpus, args.queries)
    log("computing every chunk's vector for the exact answers")
    vectors = all_vectors(corpus)
    readable = {
        c: [corpus.readable(c, q.tenant, q.group_mask) for q in queries] for c in PRINCIPAL_CLASSES
    }
    exact = {
        c: [exact_top(vectors, readable[c][n], q.vector, TOP_K) for n, q in enumerate(queries)]
        for c in PRINCIPAL_CLASSES
    }
    plain_exact = global_top(vectors, np.stack([q.vector for q in queries]), TOP_K)
    concurrency = args.concurrency
    size = max(concurrency)
    settings = SearchSettings(database_url=url, db_pool_min_size=size, db_pool_max_size=size)
    pool = await open_search_pool(settings)
    rows: list[Row] = []
    try:
        if args.prewarm:
            log(f"prewarmed {await prewarm(pool)} blocks")
        await PgVectorSink(pool, partition_graphs=True).ensure_generation(
            IndexGeneration(model, DIMENSION, STRATEGY)
        )
        generation = Generation(model, DIMENSION)
        index = PgSearchIndex(pool, generation, settings)
        exact_index = index_on_path(pool, generation, settings, VectorPath.EXACT)
        forced_index = index_on_path(pool, generation, settings, VectorPath.ANN)
        counting_index = PgSearchIndex(
            pool, generation, settings.model_copy(update={"search_path_cache_seconds": 0})
        )
        # The limit of speed: pgvector alone, neither the version join nor the ACL filter --
        # over the query's tenant (its partition's HNSW index; the ratio's base), and over
        # every tenant (every partition's index, merged).
        plain_sql = (
            "SELECT chunk_id FROM knowledge_chunk c"
            f" WHERE {model_predicate(model, 'c.embedding_model')}"
            " AND ($2::text IS NULL OR c.tenant_id = $2)"
            f" ORDER BY {vector_expression(DIMENSION, 'c.embedding')} <=> $1::vector"
            f" LIMIT {TOP_K}"
        )

        # The plain query walks what search walks (the planner prefers a tenant's own graph,
        # as it does for search), at the ef_search search gives that graph.
        graphs = {
            r["relname"]
            for r in await pool.fetch(
                "SELECT relname FROM pg_class WHERE relkind = 'i' AND relname LIKE $1",
                ann_index_name(model) + "\\_t%",
            )
        }

        def plain_ef_search(n: int, tenant: bool) -> int:
            if tenant and tenant_ann_index_name(model, tenant_name(queries[n].tenant)) in graphs:
                return settings.search_tenant_graph_ef_search
            return settings.search_ef_search

        async def plain(n: int, tenant: bool) -> Any:
            async with pool.acquire() as conn, conn.transaction(readonly=True):
                await conn.execute(
                    "SELECT set_config('hnsw.ef_search', $1, true),"
                    " set_config('plan_cache_mode', 'force_custom_plan', true)",
                    str(plain_ef_search(n, tenant)),
                )
                return await conn.fetch(
                    plain_sql,
                    queries[n].vector,
                    tenant_name(queries[n].tenant) if tenant else None,
                )

        for c in concurrency:
            samples, answers, rate, _ = await timed(lambda n: plain(n, True), len(queries), c)
            hits = sum(
                len(set(exact["all"][n]) & {int(r["chunk_id"]) for r in answer})
                for n, answer in enumerate(answers)
            )
            rows.append(Row(PLAIN_TENANT, "-", c, samples, rate, hits / (TOP_K * len(queries))))
            log(f"plain tenant c{c}: p50 {statistics.median(samples):.2f} ms")
        for c in concurrency:
            samples, answers, rate, _ = await timed(lambda n: plain(n, False), len(queries), c)
            hits = sum(
                len(set(plain_exact[n]) & {int(r["chunk_id"]) for r in answer})
                for n, answer in enumerate(answers)
            )
            rows.append(
                Row("plain pgvector, unfiltered", "-", c, samples, rate, hits / (10 * len(queries)))
            )
            log(f"plain c{c}: p50 {statistics.median(samples):.2f} ms")

        for principal_class in PRINCIPAL_CLASSES:
            for label, mode, searcher, levels, count, common in variants(
                index, exact_index, forced_index, counting_index, concurrency, len(queries)
            ):

                async def call(
                    n: int,
                    mode: SearchMode = mode,
                    principal_class: str = principal_class,
                    searcher: PgSearchIndex = searcher,
                    common: bool = common,
                ) -> tuple[Candidates, tuple[SearchHit, ...]]:
                    request = request_for(queries[n], principal_class, mode, common=common)
                    candidates = await searcher.candidates(
                        request, queries[n].vector if mode.uses_vector else None
                    )
                    return candidates, rank_results(request, candidates)

                if searcher is index:
                    await prime_paths(pool, index, queries, principal_class, mode)
                for c in levels:
                    samples, answers, rate, paired = await timed(
                        call, count, c, peer=lambda n: plain(n, True)
                    )
                    row = Row(label, principal_class, c, samples, rate, paired=paired)
                    score(row, mode, answers, exact[principal_class], readable[principal_class])
                    rows.append(row)
                    log(
                        f"{row.name} {principal_class} c{c}: p50"
                        f" {statistics.median(samples):.2f} ms,"
                        f" p95 {percentile(samples, 0.95):.2f}"
                    )
        plans = await plan_shapes(pool, index, settings, queries)
        plans |= {
            f"{c}, ANN path forced": shape
            for c, shape in (await plan_shapes(pool, forced_index, settings, queries)).items()
        }
        facts = await meta(url)
        facts["server"] = await server_facts(pool)
        facts["exact_index_bytes"] = await pool.fetchval(
            "SELECT coalesce(sum(pg_relation_size(relid)), 0)::bigint"
            "  FROM pg_partition_tree(to_regclass($1))",
            EXACT_INDEX,
        )
    finally:
        await pool.close()

    embedding = await embedding_rows(queries, concurrency, log)
    http_rows: list[Row] = []
    http_memory: dict[str, Any] = {}
    if not args.no_http:
        http_rows, http_memory = await http_measure(url, queries, concurrency, log)
    report(corpus, args, facts, rows, embedding, http_rows, http_memory, plans, readable, queries)


def global_top(vectors: Array, queries: Array, k: int) -> list[list[int]]:
    """The exact top ``k`` over every chunk, for each query (block by block)."""
    best_ids = np.zeros((len(queries), 0), dtype=np.int64)
    best_sims = np.zeros((len(queries), 0), dtype=np.float32)
    for start in range(0, len(vectors), 100_000):
        sims = queries @ vectors[start : start + 100_000].T
        ids = np.broadcast_to(np.arange(start, start + sims.shape[1]), sims.shape)
        sims = np.concatenate([best_sims, sims], axis=1)
        ids = np.concatenate([best_ids, ids], axis=1)
        keep = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        best_sims = np.take_along_axis(sims, keep, axis=1)
        best_ids = np.take_along_axis(ids, keep, axis=1)
    return [list(map(int, row)) for row in best_ids]


def score(
    row: Row,
    mode: SearchMode,
    answers: list[tuple[Candidates, tuple[SearchHit, ...]]],
    exact: list[list[int]],
    readable: list[Array],
) -> None:
    if mode is SearchMode.KEYWORD:
        row.extra["mean results"] = statistics.mean(len(hits) for _, hits in answers)
        return
    hits = wanted = filled = 0
    for n, (candidates, results) in enumerate(answers):
        got = {int(c.chunk_id) for c in candidates.vector[:TOP_K]}
        hits += len(got & set(exact[n]))
        wanted += len(exact[n])
        filled += len(results) >= min(TOP_K, len(readable[n]))
    row.recall = hits / wanted if wanted else None
    row.filled = filled / len(answers)


async def plan_shapes(
    pool: Any, index: PgSearchIndex, settings: SearchSettings, queries: list[Query]
) -> dict[str, str]:
    """The scans the planner chose for the vector list, per principal set (first query)."""
    shapes = {}
    query = queries[0]
    for principal_class in PRINCIPAL_CLASSES:
        request = request_for(query, principal_class, SearchMode.VECTOR)
        async with (
            pool.acquire() as conn,
            conn.transaction(readonly=True, isolation="repeatable_read"),
        ):
            path = await index.vector_path(conn, request)
            sql = index.vector_statement(path)
            fixed = [request.tenant_id, list(request.principals), None, None, request.depth]
            plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, *fixed, query.vector)
        scans: list[str] = []
        walk(json.loads(plan)[0]["Plan"], scans)
        shapes[principal_class] = f"{path.value}: " + ", ".join(dict.fromkeys(scans))
    return shapes


def walk(node: dict[str, Any], scans: list[str]) -> None:
    if "Scan" in node["Node Type"]:
        scans.append(f"{node['Node Type']} {node.get('Index Name', node.get('Relation Name', ''))}")
    for child in node.get("Plans", []):
        walk(child, scans)


async def prewarm(pool: Any) -> int:
    """Reads what search reads (the chunks, the pointers, ACLs and documents, and all their
    indexes) into shared_buffers, as a server that has been serving a while holds them: the
    first queries of a row otherwise measure the disk, or the OS cache."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
        # From a cold disk, reading ~8 GB takes longer than the pool's statement timeout (the
        # search pool does not reset sessions: LOCAL, for this transaction only).
        await conn.execute("SET LOCAL statement_timeout = 0")
        blocks: int = await conn.fetchval(
            "SELECT coalesce(sum(pg_prewarm(c.oid)), 0)::bigint"
            "  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'i')"
            "   AND (c.relname LIKE 'knowledge\\_chunk%' OR c.relname LIKE 'document%')"
        )
    return blocks


async def server_facts(pool: Any) -> dict[str, str]:
    async with pool.acquire() as conn:
        return {
            name: str(await conn.fetchval(f"SHOW {name}"))
            for name in ("server_version", "shared_buffers", "work_mem", "effective_cache_size")
        } | {
            "pgvector": str(
                await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            )
        }


async def embedding_rows(
    queries: list[Query], concurrency: list[int], log: Callable[[str], None]
) -> list[Row]:
    """The offline ONNX model embedding each query text alone (the default settings)."""
    from services.embedding.factory import build_embedder
    from services.embedding.settings import EmbeddingSettings

    embedder = build_embedder(EmbeddingSettings())
    rows = []
    try:
        for c in concurrency:

            async def call(n: int) -> Any:
                return await embedder.embed([queries[n].text])

            samples, _, rate, _ = await timed(call, len(queries), c)
            rows.append(Row(f"query embedding ({embedder.model})", "-", c, samples, rate))
            log(f"embedding c{c}: p50 {statistics.median(samples):.2f} ms")
    finally:
        await embedder.aclose()
    return rows


def _mib(size: float) -> str:
    return f"{size / 2**20:,.0f} MiB"


def report(
    corpus: Corpus,
    args: argparse.Namespace,
    facts: dict[str, Any],
    rows: list[Row],
    embedding: list[Row],
    http_rows: list[Row],
    http_memory: dict[str, Any],
    plans: dict[str, str],
    readable: dict[str, list[Array]],
    queries: list[Query],
) -> None:
    server = facts["server"]
    sizes = facts["sizes"]
    per_million = 1_000_000 / corpus.chunks
    tenant_chunks = np.bincount(corpus.document_tenant[corpus.chunk_document], minlength=100)
    shares = {
        c: statistics.mean(
            len(r) / tenant_chunks[q.tenant] for r, q in zip(readable[c], queries, strict=True)
        )
        for c in PRINCIPAL_CLASSES
    }
    print(
        f"{corpus.chunks:,} chunks, {corpus.documents:,} documents, 100 tenants,"
        f" {args.vectors} vectors, {args.queries} queries per row, seed {args.seed};"
        f" PostgreSQL {server['server_version']}, pgvector {server['pgvector']},"
        f" shared_buffers {server['shared_buffers']}, work_mem {server['work_mem']}"
        + (", prewarmed (pg_prewarm)." if args.prewarm else ".")
    )
    print(
        "Readable share of the query's tenant (mean): "
        + ", ".join(f"{c} {100 * shares[c]:.1f} %" for c in PRINCIPAL_CLASSES)
        + "."
    )
    print()
    print(
        f"Load {facts['load_s']:.0f} s (COPY), GIN build {facts['gin_build_s']:.0f} s,"
        f" VACUUM ANALYZE {facts['vacuum_analyze_s']:.0f} s,"
        f" HNSW build {facts['hnsw_build_s']:.0f} s"
        f" ({facts['build_settings']['maintenance_work_mem']} maintenance_work_mem,"
        f" {facts['build_settings']['max_parallel_maintenance_workers']} parallel workers)."
        f" Sizes: heap {_mib(sizes['heap'])}, HNSW {_mib(sizes['hnsw'])},"
        f" GIN {_mib(sizes['gin'])}, table + all indexes {_mib(sizes['total'])}."
        f" Per million chunks: HNSW build {facts['hnsw_build_s'] * per_million / 60:.1f} min,"
        f" HNSW {_mib(sizes['hnsw'] * per_million)}, GIN {_mib(sizes['gin'] * per_million)}."
    )
    # Loaded before migrations/0017, the database got the exact list's index when --reuse
    # migrated it: its size is read now, its build time was not taken.
    exact_bytes = facts["exact_index_bytes"]
    exact_build = facts.get("exact_build_s")
    print()
    print(
        f"Exact list's index (migrations/0017): {_mib(exact_bytes)}, per million chunks"
        f" {_mib(exact_bytes * per_million)}"
        + (
            f"; built in {exact_build:.0f} s ({exact_build * per_million:.0f} s per million)."
            if exact_build is not None
            else " (built by the migration of a database loaded before it; time not taken)."
        )
    )
    graphs = facts.get("tenant_graphs")
    if graphs:
        print()
        print(
            f"Tenant graphs (tenants of at least {graphs['min_chunks']:,} chunks):"
            f" {graphs['graphs']} built in {facts['tenant_graphs_build_s']:.0f} s"
            " (CREATE INDEX CONCURRENTLY, one at a time),"
            f" {_mib(graphs['bytes'])}; per million chunks"
            f" {facts['tenant_graphs_build_s'] * per_million / 60:.1f} min,"
            f" {_mib(graphs['bytes'] * per_million)}."
        )
    print()
    plain = {r.concurrency: r for r in rows if r.name == PLAIN_TENANT}
    print(
        "| query | principals | conc. | p50 ms | p95 ms | p99 ms | queries/s"
        " | p95 vs plain | paired plain p95 | p95 vs paired | recall@10 | topK filled |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows + embedding + http_rows:
        base = plain.get(row.concurrency)
        ratio = paired_p95 = paired_ratio = ""
        if base is not None and not row.name.startswith("query embedding"):
            ratio = f"{percentile(row.samples, 0.95) / percentile(base.samples, 0.95):.2f}x"
        if row.paired:
            paired_p95 = f"{percentile(row.paired, 0.95):.2f}"
            paired_ratio = f"{percentile(row.samples, 0.95) / percentile(row.paired, 0.95):.2f}x"
        recall = "" if row.recall is None else f"{row.recall:.3f}"
        filled = "" if row.filled is None else f"{100 * row.filled:.0f} %"
        if "mean results" in row.extra:
            filled = f"({row.extra['mean results']:.1f} results)"
        print(
            f"| {row.name} | {row.principals} | {row.concurrency}"
            f" | {statistics.median(row.samples):.2f} | {percentile(row.samples, 0.95):.2f}"
            f" | {percentile(row.samples, 0.99):.2f} | {row.per_second:.0f} | {ratio}"
            f" | {paired_p95} | {paired_ratio} | {recall} | {filled} |"
        )
    print()
    for principal_class, shape in plans.items():
        print(f"- vector list's scans, {principal_class}: {shape}")
    if http_memory:
        print(
            f"- kb serve RSS: {_mib(http_memory['ready_rss'])} when ready,"
            f" peak {_mib(http_memory['peak_rss'])} over the HTTP rows"
            f" (VmHWM; {http_memory['embedder']})"
        )
