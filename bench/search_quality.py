"""Search quality: nDCG@10, recall@10 and MRR@10 of keyword, vector and hybrid search on two
sets, each in a tenant with the 'simple' and one with the 'english' text search config.

    uv run python -m bench.search_quality                 # both sets: 9-12 min cold, 3 min warm
    uv run python -m bench.search_quality --sets examples # the labelled set only, ~1 min
    uv run python -m bench.search_quality --pairs 500     # a smaller synthetic set

1. ``examples``: the labelled set of our own (``bench/quality_examples.py``): 37 policy,
   FAQ and handbook documents in all five formats from ``examples/``, 80 queries
   (``search_quality_data/queries.jsonl``, each tagged ``exact`` or ``paraphrase``) and
   graded judgments per section (``qrels/test.tsv``, BEIR format, 2 = answers it,
   1 = related).
2. ``stdlib``: the synthetic set (``bench/quality_stdlib.py``): paragraphs of the Python
   standard library's docstrings, first sentence = query, the rest = its one relevant
   passage (``--pairs`` caps how many).

Documents run through the real parsers, chunker and embedder and are searched through the
production search statement (``bench/quality_index.py``). Metrics: ``bench/quality_metrics.py``
(graded gains, units deduplicated). Prints a Markdown report. Needs DATABASE_URL (or the dev
stack); creates and drops its own database (``--database``). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from bench import quality_stdlib
from bench.databases import drop_database, recreate_database
from bench.quality_examples import (
    DATA,
    SourceDocument,
    example_documents,
    section_id,
    sections_of,
    write_corpus,
)
from bench.quality_index import (
    PRINCIPAL,
    EmbeddingCache,
    QueryEmbedder,
    chunk_documents,
    embed_set,
    load_tenant,
    timed,
)
from bench.quality_metrics import Scores, mean, score
from services.embedding.factory import build_embedder
from services.embedding.port import Embedder
from services.embedding.settings import load_embedding_settings
from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.runtime.pg.db import create_pool
from services.runtime.pg.migrations import apply_migrations
from services.search.index_pg import PgSearchIndex
from services.search.searcher import (
    Generation,
    Searcher,
    SearchMode,
    SearchRequest,
    rank_results,
)
from services.search.statements import SearchSettings

CONFIGS = ("simple", "english")
MODES = (SearchMode.KEYWORD, SearchMode.VECTOR, SearchMode.HYBRID)


@dataclass
class QualitySet:
    name: str
    documents: list[SourceDocument]
    unit_of: Callable[[str, tuple[str, ...]], str]
    queries: dict[str, str]
    judgments: dict[str, dict[str, int]]
    kinds: dict[str, str] = field(default_factory=dict)  # query id -> exact | paraphrase
    units: int = 0


def read_queries(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    queries, kinds = {}, {}
    for line in (directory / "queries.jsonl").read_text().splitlines():
        row = json.loads(line)
        queries[row["_id"]] = row["text"]
        kinds[row["_id"]] = row.get("metadata", {}).get("kind", "")
    return queries, kinds


def read_qrels(path: Path) -> dict[str, dict[str, int]]:
    judgments: dict[str, dict[str, int]] = {}
    with path.open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            judgments.setdefault(row["query-id"], {})[row["corpus-id"]] = int(row["score"])
    return judgments


def examples_set(data: Path = DATA) -> QualitySet:
    documents = example_documents()
    units = {row["_id"] for row in sections_of(documents)}
    queries, kinds = read_queries(data)
    judgments = read_qrels(data / "qrels" / "test.tsv")
    unknown = {u for j in judgments.values() for u in j} - units
    if unknown:
        sys.exit(f"qrels name sections the example documents no longer have: {sorted(unknown)}")
    if set(queries) != set(judgments):
        sys.exit("every query needs judgments, and every judged query a text")
    return QualitySet("examples", documents, section_id, queries, judgments, kinds, len(units))


def stdlib_set(pairs: int) -> QualitySet:
    chosen = quality_stdlib.select(quality_stdlib.candidates(), pairs)
    documents = [
        SourceDocument(p.pair_id, p.source, "text/plain", p.passage.encode()) for p in chosen
    ]
    return QualitySet(
        "stdlib",
        documents,
        lambda doc_key, _path: doc_key,
        {p.pair_id: p.query for p in chosen},
        {p.pair_id: {p.pair_id: 1} for p in chosen},
        units=len(chosen),
    )


def _tenant(set_name: str, config: str) -> str:
    return f"q-{set_name}-{config}"


async def _evaluate(
    searcher: Searcher,
    qset: QualitySet,
    unit_of_chunk: dict[Any, str],
    tenant: str,
    mode: SearchMode,
) -> tuple[dict[str, Scores], int]:
    """Per-query scores, and how many queries got at least one result."""
    out = {}
    answered = 0
    for qid, text in qset.queries.items():
        result = await searcher.search(SearchRequest(tenant, text, (PRINCIPAL,), 10, mode))
        ranking = [unit_of_chunk[(h.document_id, h.chunk_id)] for h in result.results]
        answered += bool(ranking)
        out[qid] = score(ranking, qset.judgments[qid])
    return out, answered


def _row(label: str, s: Scores, extra: str = "") -> str:
    return f"| {label} | {s.ndcg10:.3f} | {s.recall10:.3f} | {s.mrr10:.3f} |{extra}"


async def run(args: argparse.Namespace) -> None:
    clock = timed()
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    embedder: Embedder = build_embedder(load_embedding_settings())
    cache = EmbeddingCache(embedder.model, enabled=not args.no_cache)
    sets = []
    if "examples" in args.sets:
        if args.write_corpus:
            write_corpus(example_documents())
        sets.append(examples_set())
    if "stdlib" in args.sets:
        sets.append(stdlib_set(args.pairs))

    lines = [
        f"model `{embedder.model}`, Python {sys.version.split()[0]},"
        f" command `{' '.join(['python -m bench.search_quality', *sys.argv[1:]])}`",
        "",
    ]
    url = await recreate_database(admin_url, args.database)
    try:
        conn = await asyncpg.connect(url)
        await apply_migrations(conn)
        await register_vector(conn)
        indexed = {}
        for qset in sets:
            t = timed()
            idx = chunk_documents(qset.documents, embedder, qset.unit_of)
            parse_s = t()
            t = timed()
            await embed_set(idx, embedder, cache)
            embed_s = t()
            t = timed()
            for config in CONFIGS:
                await load_tenant(
                    conn, _tenant(qset.name, config), config, qset.documents, idx, embedder.model
                )
            load_s = t()
            cache.save()
            indexed[qset.name] = idx
            rate = f"{idx.embedded / embed_s:.1f} chunks/s" if idx.embedded else "all cached"
            lines.append(
                f"- `{qset.name}`: {len(qset.documents)} documents, {qset.units} judged units,"
                f" {idx.chunk_count} chunks, {len(qset.queries)} queries;"
                f" parse+chunk {parse_s:.1f} s, embed {embed_s:.1f} s ({idx.embedded} chunks"
                f" embedded, {rate}), load 2 tenants {load_s:.1f} s"
            )
        await conn.close()

        settings = SearchSettings(database_url=url, db_pool_min_size=1, db_pool_max_size=2)
        pool = await create_pool(settings)
        try:
            strategy = next(iter(indexed.values())).strategy_id
            t = timed()
            await PgVectorSink(pool, partition_graphs=True).ensure_generation(
                IndexGeneration(embedder.model, embedder.dimension, strategy)
            )
            lines.append(f"- HNSW index build {t():.1f} s")
            t = timed()
            all_queries = [q for s in sets for q in s.queries.values()]
            query_embedder = await QueryEmbedder.prepared(embedder, all_queries, cache)
            cache.save()
            lines.append(f"- {len(set(all_queries))} queries embedded one by one in {t():.1f} s")
            searcher = Searcher(
                query_embedder,
                PgSearchIndex(pool, Generation(embedder.model, embedder.dimension), settings),
            )
            for qset in sets:
                if args.fusion_grid:
                    lines += await _fusion_grid(
                        searcher, query_embedder, qset, indexed[qset.name].unit_of_chunk
                    )
                else:
                    lines += await _report_set(searcher, qset, indexed[qset.name].unit_of_chunk)
        finally:
            await pool.close()
    finally:
        await embedder.aclose()
        if not args.keep_database:
            await drop_database(admin_url, args.database)
    lines.append("")
    lines.append(f"total {clock():.0f} s")
    print("\n".join(lines))


async def _report_set(
    searcher: Searcher, qset: QualitySet, unit_of_chunk: dict[Any, str]
) -> list[str]:
    lines = ["", f"### `{qset.name}`", ""]
    lines.append("| config, mode | nDCG@10 | recall@10 | MRR@10 | answered | search time |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    by_kind: list[str] = []
    verdicts = []
    for config in CONFIGS:
        means = {}
        for mode in MODES:
            t = timed()
            per_query, answered = await _evaluate(
                searcher, qset, unit_of_chunk, _tenant(qset.name, config), mode
            )
            took = t()
            means[mode] = mean(list(per_query.values()))
            label = f"{config}, {mode.value}"
            share = answered / len(qset.queries)
            lines.append(_row(label, means[mode], f" {share:.0%} | {took:.1f} s |"))
            for kind in sorted(set(qset.kinds.values()) - {""}):
                chosen = [s for q, s in per_query.items() if qset.kinds[q] == kind]
                by_kind.append(
                    _row(f"{config}, {mode.value}, {kind} ({len(chosen)})", mean(chosen))
                )
        best = max(means[SearchMode.KEYWORD].ndcg10, means[SearchMode.VECTOR].ndcg10)
        hybrid = means[SearchMode.HYBRID].ndcg10
        verdicts.append(
            f"- {config}: hybrid nDCG@10 {hybrid:.4f} vs the better single mode {best:.4f}:"
            f" target (hybrid >= better) {'MET' if hybrid >= best else 'NOT met'}"
        )
    if by_kind:
        lines += [
            "",
            "| config, mode, query kind | nDCG@10 | recall@10 | MRR@10 |",
            "|---|---:|---:|---:|",
            *by_kind,
        ]
    return [*lines, "", *verdicts]


GRID_COVERAGE = (0.0, 0.5, 0.75, 1.0)
GRID_KEYWORD_WEIGHT = (1.0, 0.5, 0.3)


async def _fusion_grid(
    searcher: Searcher,
    query_embedder: Embedder,
    qset: QualitySet,
    unit_of_chunk: dict[Any, str],
) -> list[str]:
    """Hybrid nDCG@10 for each (keyword coverage threshold, keyword weight): both ranked
    lists are read once per query, then fused every way (the fusion is in Python)."""
    index = searcher._index  # a bench reads the very lists the searcher fuses
    lines = ["", f"### `{qset.name}`: hybrid fusion grid (nDCG@10)", ""]
    header = " | ".join(f"weight {w}" for w in GRID_KEYWORD_WEIGHT)
    lines += [f"| config, min coverage | {header} |", "|---|" + "---:|" * len(GRID_KEYWORD_WEIGHT)]
    for config in CONFIGS:
        tenant = _tenant(qset.name, config)
        read = []
        for qid, text in qset.queries.items():
            request = SearchRequest(tenant, text, (PRINCIPAL,), 10, SearchMode.HYBRID)
            vector = await query_embedder.embed([text])
            read.append((qid, request, await index.candidates(request, vector)))
        for coverage in GRID_COVERAGE:
            cells = []
            for weight in GRID_KEYWORD_WEIGHT:
                scores = []
                for qid, request, candidates in read:
                    hits = rank_results(
                        request, candidates, min_keyword_coverage=coverage, keyword_weight=weight
                    )
                    ranking = [unit_of_chunk[(h.document_id, h.chunk_id)] for h in hits]
                    scores.append(score(ranking, qset.judgments[qid]))
                cells.append(f"{mean(scores).ndcg10:.4f}")
            lines.append(f"| {config}, {coverage} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="examples,stdlib", help="examples,stdlib")
    parser.add_argument("--pairs", type=int, default=2000, help="stdlib pairs (at most)")
    parser.add_argument("--database", default="kb_bench_search_quality")
    parser.add_argument("--no-cache", action="store_true", help="embed everything again")
    parser.add_argument("--keep-database", action="store_true")
    parser.add_argument(
        "--fusion-grid",
        action="store_true",
        help="hybrid nDCG@10 for a grid of keyword coverage thresholds and weights",
    )
    parser.add_argument(
        "--write-corpus",
        action="store_true",
        help="rewrite search_quality_data/corpus.jsonl from the example documents",
    )
    args = parser.parse_args()
    args.sets = {s.strip() for s in args.sets.split(",") if s.strip()}
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
