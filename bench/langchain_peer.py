"""Indexing throughput of `kb indexer run` against LangChain's ``index()``, in the same run.

    uv sync --group bench
    uv run --group bench python -m bench.langchain_peer --model onnx
    uv run --group bench python -m bench.langchain_peer --model hashing --rounds 3

The same generated corpus (``markdown-notes``: LangChain's benchmark corpus's shape, 500
short notes of ~580 characters in 1-3 paragraphs) goes through both, one after the other,
each round, with one OpenAI-compatible server for both (``bench.throughput_provider``, by
default one input per model run, inputs sorted by length: its fastest setting on 2 cores),
on the same PostgreSQL server, each in a database of its own:

- **ours**: the notes published (rows as the publisher writes them), one `kb indexer run`
  with default settings as a process (``bench.indexing_throughput``); docs/s from its first
  claim, the rate a library's timer measures in a warm process.
- **LangChain**: ``langchain_core.indexing.index()`` with its defaults (batch of 100
  documents, no cleanup), ``langchain-postgres`` PGVector (JSONB metadata) and the SQL
  record manager (``langchain-classic``), sharing one engine, the notes split by a
  ``RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200)``; timed in this
  (warm) process from the split to ``index()``'s return, the tables created beforehand.
  Its embeddings client sends each ``embed_documents`` call as one request (what
  ``OpenAIEmbeddings(check_embedding_ctx_length=False)`` does below 1,000 texts; that class
  would bring in the openai and tiktoken packages for nothing measured here).

``--partition-graphs``: our indexer runs with KB_INDEXER_PARTITION_GRAPHS=true, as before
it was off by default: every chunk insert then pays an HNSW insert into its partition's
graph (the notes' tenants stay below the tenant-graph threshold, so with it off our side
maintains no HNSW graph at all). ``--langchain-hnsw``: LangChain's embedding table gets the
HNSW index (cosine) that PGVector does not create; with ``--partition-graphs`` both sides
pay the same index maintenance (BENCHMARKS.md, "Database CPU per document").

Reports docs/s, inputs embedded and requests for each, and the ratios; and each side's CPU
seconds by process (the embedding server, the pipeline's own process, PostgreSQL's
backends), so a rate can be set against the least time that CPU takes on the machine's
cores (``cpu_bound_seconds``: the total over the cores the bench may use). Needs the ``bench``
dependency group and DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import asyncpg
import httpx

from bench.databases import recreate_database
from bench.indexing_throughput import (
    MEDIA_TYPES,
    MODEL_NAME,
    corpus,
    postgres_cpu_reader,
    process_tree_cpu_seconds,
    publish,
    reaped_cpu_seconds,
    run_indexer,
    start_provider,
)
from bench.pipeline import recreate

OURS_DB = "kb_bench_peer_ours"
LANGCHAIN_DB = "kb_bench_peer_langchain"
CORPUS = "markdown-notes"


def server_stats(base: str, reset: bool = False) -> dict[str, Any]:
    path = "/stats/reset" if reset else "/stats"
    response = httpx.post(f"{base}{path}") if reset else httpx.get(f"{base}{path}")
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


def langchain_embeddings(base: str) -> Any:
    """An ``Embeddings`` that sends each call's texts to the bench server in one request."""
    from langchain_core.embeddings import Embeddings

    class ServerEmbeddings(Embeddings):
        def __init__(self) -> None:
            self.client = httpx.Client(base_url=f"{base}/v1", timeout=300)

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            response = self.client.post("/embeddings", json={"input": texts, "model": MODEL_NAME})
            response.raise_for_status()
            rows = sorted(response.json()["data"], key=lambda row: row["index"])
            return [row["embedding"] for row in rows]

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    return ServerEmbeddings()


async def run_langchain(
    admin_url: str, base: str, server_pid: int, documents: list[bytes], *, hnsw: bool = False
) -> dict[str, Any]:
    from langchain_classic.indexes import SQLRecordManager
    from langchain_core.documents import Document
    from langchain_core.indexing import index
    from langchain_postgres import PGVector
    from langchain_text_splitters import RecursiveCharacterTextSplitter
    from sqlalchemy import create_engine, text

    url = await recreate_database(admin_url, LANGCHAIN_DB)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    store = PGVector(
        embeddings=langchain_embeddings(base),
        connection=engine,
        collection_name="notes",
        embedding_length=384,
        use_jsonb=True,
    )
    if hnsw:
        # The ANN index our sink keeps up to date on every insert (pgvector's HNSW, cosine,
        # default build settings), which PGVector does not create by default: with it, both
        # sides pay the same index maintenance per chunk.
        with engine.begin() as conn:
            conn.execute(
                text(
                    "CREATE INDEX langchain_pg_embedding_hnsw ON langchain_pg_embedding"
                    " USING hnsw (embedding vector_cosine_ops)"
                )
            )
    records = SQLRecordManager("pgvector/notes", engine=engine)
    records.create_schema()
    notes = [
        Document(page_content=content.decode(), metadata={"source": f"note-{number}"})
        for number, content in enumerate(documents)
    ]
    splitter = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200)
    postmaster = await postmaster_of(admin_url)
    postgres_before = reaped_cpu_seconds(postmaster) if postmaster else 0.0
    server_stats(base, reset=True)
    server_before = process_tree_cpu_seconds(server_pid)
    own_before = time.process_time()
    started = time.perf_counter()
    result = index(splitter.split_documents(notes), records, store)
    seconds = time.perf_counter() - started
    own_cpu = time.process_time() - own_before
    server_cpu = process_tree_cpu_seconds(server_pid) - server_before
    stats = server_stats(base)
    engine.dispose()
    await asyncio.sleep(0.5)  # the postmaster reaps the engine's backends
    postgres_cpu = reaped_cpu_seconds(postmaster) - postgres_before if postmaster else None
    return {
        "seconds": seconds,
        "docs_per_second": len(documents) / seconds,
        "chunks_added": result["num_added"],
        "inputs": stats["inputs"],
        "requests": stats["requests"],
        "model_busy_seconds": stats["busy_seconds"],
        "cpu_seconds": cpu_seconds(server_cpu, own_cpu, postgres_cpu, seconds),
    }


async def run_ours(
    admin_url: str,
    base: str,
    server_pid: int,
    documents: list[bytes],
    limit_seconds: float,
    settings: dict[str, str],
) -> dict[str, Any]:
    url = await recreate(admin_url, OURS_DB)
    await publish(url, documents, MEDIA_TYPES[CORPUS])
    server_stats(base, reset=True)
    server_before = process_tree_cpu_seconds(server_pid)
    run = await run_indexer(url, base, len(documents), limit_seconds, settings=settings)
    server_cpu = process_tree_cpu_seconds(server_pid) - server_before
    stats = server_stats(base)
    if run["first_claim_seconds"] is None or run["dead"]:
        raise SystemExit(f"the indexer did not index every note: {run}")
    seconds = run["seconds"] - run["first_claim_seconds"]
    succeeded = run["succeeded"]
    # The indexer from its first claim (start-up left out, as the rate leaves it out); the
    # database's backends over the whole run (what the start costs them is a few queries).
    indexer_cpu = run["indexer_steady_cpu_ms_per_document"] * succeeded / 1000
    postgres_ms = run["postgres_cpu_ms_per_document"]
    postgres_cpu = None if postgres_ms is None else postgres_ms * succeeded / 1000
    return {
        "seconds": seconds,
        "docs_per_second": run["succeeded"] / seconds,
        "first_claim_seconds": run["first_claim_seconds"],
        "chunks": run["chunks"],
        "inputs": stats["inputs"],
        "requests": stats["requests"],
        "model_busy_seconds": stats["busy_seconds"],
        "cpu_seconds": cpu_seconds(server_cpu, indexer_cpu, postgres_cpu, seconds),
    }


def cpu_seconds(
    server: float, pipeline: float, postgres: float | None, wall: float
) -> dict[str, float | None]:
    """A side's CPU seconds by process, their total, and the least wall time that total
    takes on the cores this bench may use: a side cannot be faster than its CPU over the
    cores, whatever it overlaps."""
    total = server + pipeline + (postgres or 0.0)
    cores = len(os.sched_getaffinity(0))
    return {
        "embedding_server": round(server, 3),
        "pipeline": round(pipeline, 3),
        "postgres": None if postgres is None else round(postgres, 3),
        "total": round(total, 3),
        "cpu_bound_seconds": round(total / cores, 3),
        "wall_seconds": round(wall, 3),
    }


async def postmaster_of(admin_url: str) -> Any:
    conn = await asyncpg.connect(admin_url)
    try:
        return await postgres_cpu_reader(conn)
    finally:
        await conn.close()


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    documents = corpus(CORPUS, args.documents)
    provider, base = start_provider(
        args.model, args.inference_batch, args.model_threads, args.runs_at_once
    )
    settings = {"KB_INDEXER_PARTITION_GRAPHS": "true" if args.partition_graphs else "false"}
    rounds = []
    try:
        for _ in range(args.rounds):
            ours = await run_ours(admin_url, base, provider.pid, documents, args.timeout, settings)
            langchain = await run_langchain(
                admin_url, base, provider.pid, documents, hnsw=args.langchain_hnsw
            )
            rounds.append(
                {
                    "ours": ours,
                    "langchain": langchain,
                    "docs_per_second_ratio": ours["docs_per_second"] / langchain["docs_per_second"],
                    "inputs_ratio": ours["inputs"] / langchain["inputs"],
                }
            )
    finally:
        provider.terminate()
        provider.wait(timeout=30)
    return {
        "corpus": CORPUS,
        "model": args.model,
        "inference_batch": args.inference_batch,
        "model_threads": args.model_threads,
        "runs_at_once": args.runs_at_once,
        "langchain_hnsw": args.langchain_hnsw,
        "partition_graphs": args.partition_graphs,
        "documents": len(documents),
        "mean_characters": sum(map(len, documents)) / len(documents),
        "rounds": rounds,
        "median_docs_per_second_ratio": statistics.median(
            r["docs_per_second_ratio"] for r in rounds
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["onnx", "hashing"], default="onnx")
    parser.add_argument("--documents", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--inference-batch",
        type=int,
        default=1,
        help="inputs per model run on the server (1: one at a time, sorted by length)",
    )
    parser.add_argument(
        "--model-threads", type=int, default=2, help="the server's intra-op threads a model run"
    )
    parser.add_argument(
        "--runs-at-once", type=int, default=1, help="model runs at once a request is shared by"
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--langchain-hnsw",
        action="store_true",
        help="give LangChain's table the HNSW index PGVector does not create",
    )
    parser.add_argument(
        "--partition-graphs",
        action="store_true",
        help="run our indexer with KB_INDEXER_PARTITION_GRAPHS=true (an HNSW insert a chunk)",
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
