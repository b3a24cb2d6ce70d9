"""Chunk rows/s through the indexer's fenced sink vs a raw COPY of the same rows into the
same table, same run, same database.

    uv run --frozen python -m bench.sink --documents 50 --chunks 200 --rounds 3

A fresh database, migrated. Each document is one version with 200 chunks of ~600 characters
and a 384-dimension float32 unit embedding. Measured, one document per transaction, one
connection, in alternating order within each round (fresh documents for every variant):

- ``sink``: ``queue.complete(lease, in_transaction=sink.writer(...))`` -- the fenced UPDATE,
  the version's earlier rows deleted, the COPY into knowledge_chunk, the forward-only pointer
  upsert and the outbox event, one transaction. The claim is not timed; building the COPY
  records (``writer()``) is, as is building them for the peer.
- ``copy``: the peer -- ``copy_records_to_table('knowledge_chunk', ...)`` of the same rows,
  one transaction per document: the least any writer of these rows must pay.

Twice: without any ANN index on knowledge_chunk, then with the model's HNSW index (what a
running system has; every insert then also pays the HNSW insertion, so that phase uses
--hnsw-documents documents per variant and round). Reported: rows/s per
variant (median of the rounds) and the sink / copy ratio.

Needs DATABASE_URL (or the dev stack, `kb dev up`). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg
import numpy as np
import numpy.typing as npt
from pgvector import Vector

from bench.databases import drop_database, recreate_database
from services.index.generation import IndexGeneration
from services.indexer.chunk import Chunk, chunk_id_of
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease
from services.runtime.pg.db import create_pool, skip_session_reset
from services.runtime.pg.migrations import apply_migrations
from services.runtime.settings import RuntimeSettings

DB = "kb_bench_sink"
DIMENSION = 384
GENERATION = IndexGeneration("bench-model-384", DIMENSION, "heading-semchunk-v1:max=256")
LEASE = 600.0
PARAGRAPH = (
    "Customers may return any item within thirty days of delivery for a full refund. "
    "Refunds reach the original card within five business days; gift cards and opened "
    "software are excluded. Write to support with the order number and the reason. "
)


@dataclass(frozen=True)
class Document:
    document_id: uuid.UUID
    chunks: list[Chunk]
    vectors: npt.NDArray[np.float32]


@dataclass(frozen=True)
class Batch:
    tier: str
    documents: list[Document]


def make_document(rng: np.random.Generator, chunks: int) -> Document:
    document_id = uuid.uuid4()
    made = []
    for ordinal in range(chunks):
        path = ("Refund policy", f"Section {ordinal // 10}")
        text = f"{ordinal}. " + PARAGRAPH * 3
        digest = hashlib.sha256(f"{' > '.join(path)}\n\n{text}".encode()).digest()
        chunk_id = chunk_id_of(
            document_id=document_id,
            version_number=1,
            strategy_id=GENERATION.chunking_strategy,
            ordinal=ordinal,
            heading_path=path,
            content_digest=digest,
        )
        made.append(Chunk(chunk_id, ordinal, path, text, digest))
    vectors = rng.standard_normal((chunks, DIMENSION)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return Document(document_id, made, vectors)


async def create_batch(
    pool: asyncpg.Pool[Any], name: str, rng: np.random.Generator, documents: int, chunks: int
) -> Batch:
    """``documents`` published versions with PENDING tasks, in a tier of their own (so a
    claim takes exactly this batch)."""
    batch = Batch(name, [make_document(rng, chunks) for _ in range(documents)])
    ids = [document.document_id for document in batch.documents]
    await pool.execute("INSERT INTO tenant (tenant_id, tier) VALUES ($1, $1)", name)
    await pool.execute(
        """
        WITH doc AS (
            INSERT INTO document (tenant_id, document_id, title, latest_version,
                                  published_version, published_at)
            SELECT $1, id, 'bench document', 1, 1, now() FROM unnest($2::uuid[]) AS id
        ), version AS (
            INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                          media_type, sha256, size_bytes, status, published_at)
            SELECT $1, id, 1, 'x', 'text/plain', sha256('x'), 1, 'PUBLISHED', now()
              FROM unnest($2::uuid[]) AS id
        )
        INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier,
                                next_attempt_at)
        SELECT gen_random_uuid(), $1, id, 1, $1, now() - interval '1 minute'
          FROM unnest($2::uuid[]) AS id
        """,
        name,
        ids,
    )
    return batch


Variant: TypeAlias = "Callable[[asyncpg.Pool[Any], Batch], Awaitable[float]]"


async def run_sink(pool: asyncpg.Pool[Any], batch: Batch) -> float:
    queue = PgTaskQueue(pool)
    sink = PgVectorSink(pool)
    leases = await queue.claim(batch.tier, "bench", lease_seconds=LEASE, limit=len(batch.documents))
    by_document: dict[uuid.UUID, Lease] = {lease.document_id: lease for lease in leases}
    assert len(by_document) == len(batch.documents)
    started = time.perf_counter()
    for document in batch.documents:
        lease = by_document[document.document_id]
        write = sink.writer(lease, GENERATION, document.chunks, document.vectors)
        await queue.complete(lease, in_transaction=write)
    return time.perf_counter() - started


async def run_copy(pool: asyncpg.Pool[Any], batch: Batch) -> float:
    columns = (
        "tenant_id",
        "document_id",
        "version_number",
        "embedding_model",
        "chunking_strategy",
        "chunk_id",
        "ordinal",
        "heading_path",
        "text",
        "content_digest",
        "embedding_dimension",
        "embedding",
    )
    started = time.perf_counter()
    async with pool.acquire() as conn:
        for document in batch.documents:
            vectors = np.ascontiguousarray(document.vectors, dtype=np.float32)
            records = [
                (
                    batch.tier,
                    document.document_id,
                    1,
                    GENERATION.embedding_model,
                    GENERATION.chunking_strategy,
                    chunk.chunk_id,
                    chunk.ordinal,
                    list(chunk.heading_path),
                    chunk.text,
                    chunk.content_digest,
                    DIMENSION,
                    Vector(vectors[row]),
                )
                for row, chunk in enumerate(document.chunks)
            ]
            async with conn.transaction():
                await conn.copy_records_to_table(
                    "knowledge_chunk", records=records, columns=columns
                )
    return time.perf_counter() - started


async def phase(
    pool: asyncpg.Pool[Any],
    label: str,
    variants: dict[str, Variant],
    *,
    rounds: int,
    documents: int,
    chunks: int,
    rng: np.random.Generator,
) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(rounds):
        # Alternate the order: the table (and its indexes) grows as the run goes on.
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            batch = await create_batch(pool, f"{label}-{name}-{round_}", rng, documents, chunks)
            seconds = await variants[name](pool, batch)
            rate = documents * chunks / seconds
            rates[name].append(rate)
            print(f"  {label} round {round_ + 1} {name:>12}: {rate:8.0f} rows/s", file=sys.stderr)
    return rates


def report(label: str, rates: dict[str, list[float]]) -> list[str]:
    median = {name: statistics.median(values) for name, values in rates.items()}
    lines = [f"### {label}", "", "| variant | rows/s (median) | rounds |", "|---|---:|---|"]
    for name, value in median.items():
        rounds = ", ".join(f"{rate:.0f}" for rate in rates[name])
        lines.append(f"| {name} | {value:.0f} | {rounds} |")
    lines.append("")
    for numerator, denominator in (("sink", "copy"),):
        if numerator in rates and denominator in rates:
            # Per round (the variants of one round ran back to back, under the same load).
            ratios = [a / b for a, b in zip(rates[numerator], rates[denominator], strict=True)]
            lines.append(
                f"{numerator} / {denominator}: median **{statistics.median(ratios):.2f}x** "
                f"(rounds: {', '.join(f'{ratio:.2f}' for ratio in ratios)})"
            )
            lines.append("")
    return lines


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=50)
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--hnsw-documents",
        type=int,
        default=10,
        help="documents per variant and round with the HNSW index (inserts are ~10x slower)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    args = parser.parse_args(argv)

    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit("DATABASE_URL is not set (run `kb dev up` or point it at PostgreSQL)")
    url = await recreate_database(admin_url, DB)
    try:
        conn = await asyncpg.connect(url)
        try:
            await apply_migrations(conn)
        finally:
            await conn.close()
        settings = RuntimeSettings(database_url=url, kafka_bootstrap_servers="127.0.0.1:1")
        pool = await create_pool(settings, min_size=2, max_size=2, reset=skip_session_reset)
        rng = np.random.default_rng(20261202)
        sizes = {"rounds": args.rounds, "documents": args.documents, "chunks": args.chunks}
        try:
            plain = await phase(
                pool,
                "plain",
                {"sink": run_sink, "copy": run_copy},
                rng=rng,
                **sizes,
            )
            # The HNSW index starts empty (building it over the plain phase's rows would take
            # minutes) and grows through the phase, for both variants alike.
            await pool.execute("TRUNCATE knowledge_chunk")
            await PgVectorSink(pool, partition_graphs=True).ensure_generation(GENERATION)
            hnsw = await phase(
                pool,
                "hnsw",
                {"sink": run_sink, "copy": run_copy},
                rng=rng,
                **{**sizes, "documents": args.hnsw_documents},
            )
            server = await pool.fetchval("SHOW server_version")
        finally:
            await pool.close()
    finally:
        if not args.keep:
            await drop_database(admin_url, DB)

    lines = [
        f"{args.documents} documents x {args.chunks} chunks (dimension {DIMENSION}) per variant "
        f"and round, {args.rounds} rounds, one connection; PostgreSQL {server}.",
        "",
        *report("No ANN index on knowledge_chunk", plain),
        *report(
            f"With the model's HNSW index (m=16, ef_construction=64, cosine), "
            f"{args.hnsw_documents} documents per variant and round",
            hnsw,
        ),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
