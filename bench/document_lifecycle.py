"""Delete -> gone from search against publish -> searchable, and the erase rate of a large
document against its indexing, in one run (issue 43, docs/architecture.md#document-
lifecycle).

    uv run python -m bench.document_lifecycle --documents 100 --chunks 10000

On a scratch database of the server of DATABASE_URL (``--database``), in this process: the
composed app (publisher + search, `tests.support.search.search_harness`) over HTTP in memory,
and an indexer worker with the pipeline (hashing embedder, 64 dimensions) running beside it.

1. Publish -> searchable (the peer): ``--documents`` one-paragraph documents, each with a
   word of its own, published one after the other; per document, the time from the publish's
   answer until a search for its word returns it (searches back to back).
2. Delete -> gone: the same documents deleted one after the other; per document, the time
   from the DELETE's answer until a search for its word no longer returns it, on the primary
   (the delete's answer includes removing its chunks, after its commit). The replica layout
   (the delete's ``searchToken`` in ``after``) needs a streaming replica, which this bench
   does not start: see `bench/search_replicas.py` for the token's wait on one.
3. Erase of a large document: one document of ``--chunks`` chunks (16-token chunks) is
   published and indexed (timed: publish's answer -> searchable), then erased through the API
   (timed: the erase's answer, every batch of KB_PUBLISHER_ERASE_BATCH_ROWS included):
   chunks/s, and the erase time over the indexing time of the same document.

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from bench.databases import drop_database, recreate_database
from bench.search_scale_timing import percentile
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import Worker
from services.indexer.retry import RetryPolicy
from services.runtime.logging import configure_logging
from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, add_tenant, publish, upload
from tests.support.pipeline import running_pipeline
from tests.support.search import SearchHarness, search_harness

BENCH_DB = "kb_bench_document_lifecycle"
# One chunk per clause at 16 tokens: the large document's size in chunks is its clauses.
LARGE_MAX_TOKENS = 16


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def word(n: int) -> str:
    """A word no other document has (letters only: the keyword path tokenizes it whole)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "zq" + "".join(letters[(n // 26**i) % 26] for i in range(4))


async def found(api: SearchHarness, tenant: ApiTenant, query: str) -> set[str]:
    body = {"query": query, "principals": ["group:all"], "mode": "keyword", "topK": 10}
    response = await api.search(tenant, body)
    response.raise_for_status()
    return {hit["documentId"] for hit in response.json()["results"]}


async def until(check: Callable[[], Awaitable[bool]], limit_seconds: float) -> float:
    """Seconds until ``check`` is true, checked back to back from now."""
    started = time.perf_counter()
    async with asyncio.timeout(limit_seconds):
        while not await check():
            pass
    return time.perf_counter() - started


async def published(api: SearchHarness, tenant: ApiTenant, content: bytes) -> tuple[str, int]:
    response = await upload(api.client, tenant, content)
    response.raise_for_status()
    document_id = response.json()["documentId"]
    response = await publish(api.client, tenant, document_id, 1, 1, read=["group:all"])
    response.raise_for_status()
    return document_id, int(response.json()["revision"])


def summary(samples: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples]
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
        "max_ms": round(max(ms), 2),
    }


async def searchable_then_gone(
    api: SearchHarness, tenant: ApiTenant, documents: int
) -> dict[str, Any]:
    searchable: list[float] = []
    ids: list[tuple[str, int, str]] = []
    for n in range(documents):
        text = f"Refunds are paid within thirty days. Code {word(n)}.".encode()
        document_id, revision = await published(api, tenant, text)

        async def appeared(document_id: str = document_id, n: int = n) -> bool:
            return document_id in await found(api, tenant, word(n))

        searchable.append(await until(appeared, 120))
        ids.append((document_id, revision, word(n)))
    log(f"{documents} documents searchable")
    gone: list[float] = []
    first_search_already_gone = 0
    for document_id, revision, query in ids:
        response = await api.client.delete(
            tenant.path(f"/documents/{document_id}"),
            params={"revision": revision},
            headers=tenant.headers,
        )
        response.raise_for_status()
        searches = 0

        async def vanished(document_id: str = document_id, query: str = query) -> bool:
            nonlocal searches
            searches += 1
            return document_id not in await found(api, tenant, query)

        gone.append(await until(vanished, 30))
        first_search_already_gone += searches == 1
    log(f"{documents} documents deleted")
    return {
        "documents": documents,
        "publish_to_searchable": summary(searchable),
        "delete_to_gone_primary": summary(gone),
        "gone_at_the_first_search_after_the_answer": first_search_already_gone,
        "delete_over_publish_p50": round(
            statistics.median(gone) / statistics.median(searchable), 4
        ),
        "delete_to_gone_replica": "not measured: no streaming replica in this run",
    }


async def erase_large(
    api: SearchHarness, tenant: ApiTenant, pool: asyncpg.Pool[Any], chunks: int
) -> dict[str, Any]:
    marker = "zqlargemarker"
    text = "\n\n".join(f"Clause {n} {marker}." for n in range(chunks)).encode()
    started = time.perf_counter()
    document_id, _ = await published(api, tenant, text)

    async def indexed() -> bool:
        await asyncio.sleep(0.2)  # a poll, not a race: the indexing takes seconds
        return bool(
            await pool.fetchval(
                "SELECT chunk_count FROM document_search_version WHERE document_id = $1",
                uuid.UUID(document_id),
            )
        )

    await until(indexed, 3600)
    indexing = time.perf_counter() - started
    stored = await pool.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", uuid.UUID(document_id)
    )
    log(f"large document indexed: {stored} chunks in {indexing:.1f} s")
    started = time.perf_counter()
    response = await api.client.post(
        tenant.path(f"/documents/{document_id}/erase"), headers=tenant.headers
    )
    response.raise_for_status()
    erasing = time.perf_counter() - started
    left = await pool.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", uuid.UUID(document_id)
    )
    if left:
        raise SystemExit(f"{left} chunks left after the erase")
    return {
        "chunks": stored,
        "indexing_seconds": round(indexing, 2),
        "erase_seconds": round(erasing, 2),
        "erase_chunks_per_second": round(stored / erasing, 1),
        "erase_over_indexing": round(erasing / indexing, 4),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    url = await recreate_database(admin_url, args.database, migrate=True)
    settings = RuntimeSettings(database_url=url)
    try:
        async with search_harness(settings, pool_size=8) as api:
            conn = await asyncpg.connect(url)
            try:
                tenant = await add_tenant(conn, "bench", "standard")
            finally:
                await conn.close()
            results: dict[str, Any] = {}
            async with running_pipeline(api.pool) as indexer:
                results["delete"] = await with_worker(
                    api.pool, indexer, searchable_then_gone(api, tenant, args.documents)
                )
            async with running_pipeline(api.pool, max_tokens=LARGE_MAX_TOKENS) as indexer:
                results["erase"] = await with_worker(
                    api.pool, indexer, erase_large(api, tenant, api.pool, args.chunks)
                )
            return results
    finally:
        if not args.keep:
            await drop_database(admin_url, args.database)


async def with_worker(pool: asyncpg.Pool[Any], indexer: Any, work: Awaitable[Any]) -> Any:
    """``work`` with an indexer worker claiming the tasks it makes, stopped after it."""
    worker = Worker(
        PgTaskQueue(pool),
        indexer,
        tier="standard",
        owner="bench-lifecycle",
        policy=RetryPolicy(jitter=0),
        poll_interval_seconds=0.05,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        return await work
    finally:
        stop.set()
        await running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--database", default=BENCH_DB)
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = parser.parse_args()
    configure_logging("warning", "console", service="bench")  # on stderr, not in the result
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
