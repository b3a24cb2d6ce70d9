"""Search latency and HNSW recall at 100,000 chunks, one tenant (the earlier bench).

    uv run python -m bench.search_scale_single --chunks 100000 --queries 200

Kept because ``bench.keyword_ab`` measures the database it loads (``kb_bench_search``);
``bench.search_latency`` is the multi-tenant bench of issue 10.

A fresh database (``kb_bench_search``, our migrations) holds one tenant's documents of 20
chunks each: random unit vectors of dimension 384 and real-ish text (words drawn from a
Zipf distribution over a fixed English vocabulary), every document's version 1 behind its
search pointer, the model's HNSW index built as the indexer's sink builds it. Every
document is readable by ``group:all``; ``group:few`` may read 2% of them.

Measured, one connection, queries one after another, the query vector given (embedding
time is the model's, not search's):
- search's candidate statement (``PgSearchIndex.candidates``, the transaction included) in
  vector, keyword and hybrid mode, topK 10, as ``group:all`` and as ``group:few``;
- the peer: a plain unfiltered pgvector query on the same HNSW index
  (``ORDER BY embedding <=> q LIMIT 10``), same session settings;
- recall@10 of vector mode against the exact top 10 under the same filter (numpy, over
  the vectors the script wrote).

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import numpy as np
from pgvector.asyncpg import register_vector

from bench.databases import recreate_database
from bench.search_data import PublishedRows, chunk_row
from services.index.ann import model_predicate, vector_expression
from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.runtime.pg.db import create_pool
from services.runtime.pg.migrations import apply_migrations
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings

DB = "kb_bench_search"
MODEL = "bench-random-384"
DIMENSION = 384
STRATEGY = "bench"
TENANT = "bench"
CHUNKS_PER_DOCUMENT = 20
FEW_EVERY = 50  # group:few reads one document in 50
CLUSTERS = 1000
CLUSTER_NOISE = 1.0  # noise norm relative to the unit centroid

_WORDS = """
refund policy customer order payment invoice shipping delivery return exchange warranty
product service account password security login access permission group admin user team
project report quarter revenue budget forecast contract agreement term condition notice
period employee manager holiday leave salary benefit insurance health travel expense
receipt approval request ticket support incident outage backup restore server database
network storage cloud region latency error retry timeout queue worker task document
version publish index search chunk vector embedding model token language english french
german spanish translation review draft final legal compliance privacy data retention
deletion export import audit log event metric alert dashboard release feature roadmap
customer partner vendor supplier price discount tax currency bank transfer card charge
fee subscription plan trial upgrade downgrade cancel renew annual monthly weekly daily
office building floor room meeting calendar schedule deadline
"""
VOCABULARY = _WORDS.split()


async def recreate(admin_url: str) -> str:
    return await recreate_database(admin_url, DB)


def text_for(rng: np.random.Generator, words: int) -> str:
    ranks = np.minimum(rng.zipf(1.3, size=words), len(VOCABULARY)) - 1
    return " ".join(VOCABULARY[int(r)] for r in ranks).capitalize() + "."


def unit_vectors(
    rng: np.random.Generator, count: int, centroids: np.ndarray[Any, Any] | None
) -> np.ndarray[Any, Any]:
    """Uniform on the sphere, or (``centroids``) around topics, as real embeddings cluster."""
    noise = rng.standard_normal((count, DIMENSION)).astype(np.float32)
    if centroids is not None:
        picks = centroids[rng.integers(len(centroids), size=count)]
        noise = picks + CLUSTER_NOISE * noise / np.sqrt(DIMENSION)
    vectors: np.ndarray[Any, Any] = noise / np.linalg.norm(noise, axis=1, keepdims=True)
    return vectors


async def load(
    url: str, chunks: int, rng: np.random.Generator, centroids: np.ndarray[Any, Any] | None
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Writes the corpus; returns every chunk's vector and whether group:few may read it."""
    documents = chunks // CHUNKS_PER_DOCUMENT
    vectors = unit_vectors(rng, documents * CHUNKS_PER_DOCUMENT, centroids)
    few = np.zeros(len(vectors), dtype=bool)
    conn = await asyncpg.connect(url)
    try:
        await apply_migrations(conn)
        await register_vector(conn)
        await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ($1, 'standard')", TENANT)
        rows = PublishedRows(MODEL, STRATEGY)
        for d in range(documents):
            document_id = uuid.UUID(int=d + 1)
            principals = ["group:all"]
            if d % FEW_EVERY == 0:
                principals.append("group:few")
                few[d * CHUNKS_PER_DOCUMENT : (d + 1) * CHUNKS_PER_DOCUMENT] = True
            rows.add_document(
                TENANT,
                document_id,
                f"Document {d}",
                f"document {d}".encode(),
                principals,
                chunk_count=CHUNKS_PER_DOCUMENT,
            )
            for o in range(CHUNKS_PER_DOCUMENT):
                i = d * CHUNKS_PER_DOCUMENT + o
                text = text_for(rng, int(rng.integers(40, 120)))
                heading = [VOCABULARY[int(rng.integers(len(VOCABULARY)))].capitalize()]
                rows.chunks.append(
                    chunk_row(
                        TENANT,
                        document_id,
                        MODEL,
                        STRATEGY,
                        f"{d}-{o}",
                        o,
                        heading,
                        text,
                        vectors[i],
                    )
                )
        await rows.copy(conn)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()
    return vectors, few


def chunk_index(chunk_id: str) -> int:
    document, ordinal = chunk_id.split("-")
    return int(document) * CHUNKS_PER_DOCUMENT + int(ordinal)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(
    call: Callable[[int], Awaitable[Any]], queries: int
) -> tuple[list[float], list[Any]]:
    for warm in range(min(10, queries)):
        await call(warm)
    samples, answers = [], []
    for n in range(queries):
        started = time.perf_counter()
        answers.append(await call(n))
        samples.append((time.perf_counter() - started) * 1000)
    return samples, answers


async def run(args: argparse.Namespace) -> None:
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    url = await recreate(admin_url)
    rng = np.random.default_rng(args.seed)
    centroids = None
    if args.vectors == "clustered":
        centroids = unit_vectors(rng, CLUSTERS, None)
    started = time.perf_counter()
    vectors, few = await load(url, args.chunks, rng, centroids)
    loaded = time.perf_counter() - started
    settings = SearchSettings(database_url=url, db_pool_min_size=1, db_pool_max_size=2)
    pool = await create_pool(settings)
    try:
        started = time.perf_counter()
        # The graph must fit in maintenance_work_mem or the build crawls (15 min vs a few at
        # 100k x 384 here).
        sink = PgVectorSink(pool, index_build_memory="1GB", partition_graphs=True)
        await sink.ensure_generation(IndexGeneration(MODEL, DIMENSION, STRATEGY))
        built = time.perf_counter() - started
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE knowledge_chunk")
        index = PgSearchIndex(pool, Generation(MODEL, DIMENSION), settings)
        query_vectors = unit_vectors(rng, args.queries, centroids)
        query_texts = [" ".join(rng.choice(VOCABULARY, size=2)) for _ in range(args.queries)]

        plain_sql = (
            "SELECT chunk_id FROM knowledge_chunk c"
            f" WHERE {model_predicate(MODEL, 'c.embedding_model')}"
            f" ORDER BY {vector_expression(DIMENSION, 'c.embedding')} <=> $1::vector LIMIT 10"
        )

        async def plain(n: int) -> Any:
            async with pool.acquire() as conn, conn.transaction(readonly=True):
                await conn.execute(
                    "SELECT set_config('hnsw.ef_search', $1, true)", str(settings.search_ef_search)
                )
                return await conn.fetch(plain_sql, query_vectors[n])

        rows: list[tuple[str, str, list[float], float | None]] = []
        plain_ms, plain_answers = await timed(plain, args.queries)
        plain_hits = 0
        for n, answer in enumerate(plain_answers):
            exact = set(np.argsort(-(vectors @ query_vectors[n]))[:10].tolist())
            plain_hits += len(exact & {chunk_index(r["chunk_id"]) for r in answer})
        rows.append(("plain pgvector, unfiltered", "-", plain_ms, plain_hits / (10 * args.queries)))
        for principal, mask in (
            ("group:all", np.ones(len(vectors), dtype=bool)),
            ("group:few", few),
        ):
            for mode in (SearchMode.VECTOR, SearchMode.KEYWORD, SearchMode.HYBRID):

                def call(n: int, mode: SearchMode = mode, principal: str = principal) -> Any:
                    request = SearchRequest(
                        TENANT, query_texts[n], (principal,), top_k=10, mode=mode
                    )
                    return index.candidates(request, query_vectors[n])

                samples, answers = await timed(call, args.queries)
                recall = None
                if mode is SearchMode.VECTOR:
                    allowed = np.flatnonzero(mask)
                    hits = 0
                    for n, answer in enumerate(answers):
                        sims = vectors[allowed] @ query_vectors[n]
                        exact = {int(allowed[i]) for i in np.argsort(-sims)[:10]}
                        hits += len(exact & {chunk_index(c.chunk_id) for c in answer.vector})
                    recall = hits / (10 * len(answers))
                rows.append((f"search {mode.value}", principal, samples, recall))

        async with pool.acquire() as conn:
            size = await conn.fetchval(
                "SELECT pg_size_pretty(pg_total_relation_size('knowledge_chunk'))"
            )
            server = await conn.fetchval("SHOW server_version")
            pgvector = await conn.fetchval(
                "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
            )
        plain_p50 = statistics.median(plain_ms)
        print(
            f"chunks {len(vectors)}, documents {len(vectors) // CHUNKS_PER_DOCUMENT}, "
            f"group:few reads {int(few.sum())} chunks; PostgreSQL {server}, pgvector {pgvector}; "
            f"knowledge_chunk {size}; load {loaded:.0f}s, HNSW build {built:.0f}s; "
            f"ef_search {settings.search_ef_search}, {args.queries} queries each, "
            f"{args.vectors} vectors"
        )
        print()
        print("| query | principals | p50 ms | p95 ms | p50 vs plain | recall@10 |")
        print("|---|---|---:|---:|---:|---:|")
        for name, principal, samples, recall in rows:
            p50 = statistics.median(samples)
            print(
                f"| {name} | {principal} | {p50:.2f} | {percentile(samples, 0.95):.2f} | "
                f"{p50 / plain_p50:.2f}x | {'' if recall is None else f'{recall:.3f}'} |"
            )
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--vectors", choices=["random", "clustered"], default="random")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
