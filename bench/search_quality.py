"""Search quality on a small labelled set in BEIR format: vector vs keyword vs hybrid.

    uv run python -m bench.search_quality [--data bench/search_quality_data]

The set (``corpus.jsonl``, ``queries.jsonl``, ``qrels/test.tsv``) is ours: 36 short policy
passages and 30 queries, most of them paraphrases (the words differ from the passage's),
a few exact terms (error codes, product names). Each passage is one document of one chunk
(heading = its title), embedded by the default offline model (int8 all-MiniLM-L6-v2) as
the pipeline embeds a chunk ("title\\n\\ntext"), queries embedded by the same model. Two
tenants hold the same corpus, one with the 'simple' text search configuration and one with
'english' (stemming, stop words). Reported per mode: recall@5, MRR@10, nDCG@10 (binary
relevance). A small set: differences of a few points are noise.

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
from pgvector.asyncpg import register_vector

from services.indexer.embedding.factory import build_embedder
from services.indexer.embedding.settings import load_embedding_settings
from services.indexer.search import Generation, Searcher, SearchMode, SearchRequest
from services.indexer.search_pg import PgSearchIndex, SearchSettings
from services.indexer.sink_pgvector import IndexGeneration, PgVectorSink
from services.runtime.db import create_pool
from services.runtime.migrations import apply_migrations

DB = "kb_bench_search_quality"
STRATEGY = "bench-one-chunk"
DATA = Path(__file__).resolve().parent / "search_quality_data"
CONFIGS = {"q-simple": "simple", "q-english": "english"}


def read_beir(
    directory: Path,
) -> tuple[dict[str, dict[str, str]], dict[str, str], dict[str, set[str]]]:
    corpus = {}
    for line in (directory / "corpus.jsonl").read_text().splitlines():
        row = json.loads(line)
        corpus[row["_id"]] = {"title": row.get("title", ""), "text": row["text"]}
    queries = {}
    for line in (directory / "queries.jsonl").read_text().splitlines():
        row = json.loads(line)
        queries[row["_id"]] = row["text"]
    qrels: dict[str, set[str]] = {}
    with (directory / "qrels" / "test.tsv").open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if int(row["score"]) > 0:
                qrels.setdefault(row["query-id"], set()).add(row["corpus-id"])
    return corpus, queries, qrels


def metrics(ranked: list[str], relevant: set[str]) -> tuple[float, float, float]:
    recall5 = len(set(ranked[:5]) & relevant) / len(relevant)
    mrr = next((1 / (i + 1) for i, d in enumerate(ranked[:10]) if d in relevant), 0.0)
    dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(ranked[:10]) if d in relevant)
    ideal = sum(1 / math.log2(i + 2) for i in range(min(10, len(relevant))))
    return recall5, mrr, dcg / ideal


async def run(args: argparse.Namespace) -> None:
    corpus, queries, qrels = read_beir(Path(args.data))
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:55432/kb")
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{DB}"')
    finally:
        await admin.close()
    url = admin_url.rpartition("/")[0] + "/" + DB
    embedder = build_embedder(load_embedding_settings())
    ids = list(corpus)
    vectors = await embedder.embed([f"{corpus[i]['title']}\n\n{corpus[i]['text']}" for i in ids])
    doc_ids = {i: uuid.UUID(bytes=hashlib.sha256(i.encode()).digest()[:16]) for i in ids}
    by_uuid = {v: k for k, v in doc_ids.items()}
    conn = await asyncpg.connect(url)
    try:
        await apply_migrations(conn)
        await register_vector(conn)
        for tenant, config in CONFIGS.items():
            await conn.execute(
                "INSERT INTO tenant (tenant_id, tier, text_search_config)"
                " VALUES ($1, 'standard', $2::regconfig)",
                tenant,
                config,
            )
            for n, i in enumerate(ids):
                await _add(conn, tenant, doc_ids[i], corpus[i], vectors[n], embedder.model)
    finally:
        await conn.close()
    settings = SearchSettings(database_url=url, db_pool_min_size=1, db_pool_max_size=2)
    pool = await create_pool(settings)
    try:
        await PgVectorSink(pool).ensure_generation(
            IndexGeneration(embedder.model, embedder.dimension, STRATEGY)
        )
        searcher = Searcher(
            embedder,
            PgSearchIndex(pool, Generation(embedder.model, embedder.dimension), settings),
        )
        print(f"{len(corpus)} passages, {len(queries)} queries, model {embedder.model}")
        print()
        print("| text search config | mode | recall@5 | MRR@10 | nDCG@10 |")
        print("|---|---|---:|---:|---:|")
        for tenant, config in CONFIGS.items():
            for mode in (SearchMode.VECTOR, SearchMode.KEYWORD, SearchMode.HYBRID):
                totals = np.zeros(3)
                for qid, text in queries.items():
                    result = await searcher.search(
                        SearchRequest(tenant, text, ("group:all",), top_k=10, mode=mode)
                    )
                    ranked = [by_uuid[h.document_id] for h in result.results]
                    totals += metrics(ranked, qrels[qid])
                r5, mrr, ndcg = totals / len(queries)
                print(f"| {config} | {mode.value} | {r5:.3f} | {mrr:.3f} | {ndcg:.3f} |")
    finally:
        await pool.close()
        await embedder.aclose()


async def _add(
    conn: asyncpg.Connection[Any],
    tenant: str,
    document_id: uuid.UUID,
    passage: dict[str, str],
    vector: Any,
    model: str,
) -> None:
    content = passage["text"].encode()
    await conn.execute(
        "INSERT INTO document (tenant_id, document_id, title, latest_version, published_version)"
        " VALUES ($1, $2, $3, 1, 1)",
        tenant,
        document_id,
        passage["title"],
    )
    await conn.execute(
        "INSERT INTO document_version (tenant_id, document_id, version_number, content,"
        " media_type, sha256, size_bytes, status)"
        " VALUES ($1, $2, 1, $3, 'text/plain', $4, $5, 'PUBLISHED')",
        tenant,
        document_id,
        content,
        hashlib.sha256(content).digest(),
        len(content),
    )
    await conn.execute(
        "INSERT INTO document_acl VALUES ($1, $2, 'group:all', 'READ')", tenant, document_id
    )
    await conn.execute(
        "INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,"
        " chunk_id, ordinal, heading_path, text, content_digest, embedding_dimension, embedding,"
        " chunking_strategy) VALUES ($1, $2, 1, $3, 'c0', 0, $4, $5, $6, $7, $8, $9)",
        tenant,
        document_id,
        model,
        [passage["title"]],
        passage["text"],
        hashlib.sha256(content).digest(),
        len(vector),
        np.asarray(vector, dtype=np.float32),
        STRATEGY,
    )
    await conn.execute(
        "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
        " embedding_model, chunking_strategy) VALUES ($1, $2, 1, $3, $4)",
        tenant,
        document_id,
        model,
        STRATEGY,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA))
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
