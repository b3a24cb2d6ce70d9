"""The indexing pipeline measured against its limit, the model itself, in the same run.

    uv run python -m bench.pipeline --documents 40 --sections 24 --slots 2

1. Efficiency: ``--documents`` distinct Markdown documents (``--sections`` sections each)
   are indexed end to end -- PgTaskQueue claims, Worker, parse processes, the local ONNX
   model, the pgvector sink's fenced write -- and timed from the first claim to the last
   commit (documents/s). The limit is the same chunks embedded by the bare model in a loop
   of ``embedding_batch_size`` batches, timed before and after the pipeline run (the machine
   is shared; the mean of both is the limit). Reported: pipeline / limit.
2. Incremental: a 200-section document indexed as v1, then v2 with one paragraph changed:
   provider requests and texts, and wall time, v2 vs v1.
3. Memory (``--memory-mb``, 0 to skip): a child process indexes one text file and one PDF of
   about that size, as ``kb indexer run`` would (Worker, PgTaskQueue, the parse process, the
   streaming pipeline with its default slice and threshold, the pgvector sink); a sampler
   thread reads /proc every 20 ms: the indexer's and its parse worker's resident memory,
   the peak of each (``VmHWM``, which also catches peaks between samples) and the peak of
   their sum (sampled). ``--memory-embedder`` picks the model: ``onnx-first`` (default)
   loads the real ONNX model and embeds the first ``--memory-model-texts`` chunks with it
   (the model's session, its activations and its tokenizer are in the indexer's peak), then
   a hashing embedder of the same dimension behind the same port embeds the rest -- the ONNX
   model would take hours on 70,000+ chunks here; ``onnx`` uses the model throughout;
   ``hashing`` leaves the model out (its memory is then not included).

Needs DATABASE_URL (or the dev stack). Uses its own database, kb_bench_pipeline.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg

from bench.databases import recreate_database
from services.embedding.hashing import HashingEmbedder
from services.embedding.onnx_local import OnnxLocalEmbedder
from services.embedding.port import Embedder, Vectors
from services.embedding.tokens import TokenizerSpec, load_token_counter
from services.indexer.pipeline.chunking import chunk_sections
from services.indexer.pipeline.parsing import ParseLimits, parse_document
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.version_indexer import chunking_strategy
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker, WorkerEvent
from services.indexer.retry import RetryPolicy
from services.runtime.logging import configure_logging
from services.runtime.pg.db import create_pool, skip_session_reset
from services.runtime.settings import RuntimeSettings
from tests.support.pipeline import RecordingEmbedder, running_pipeline
from tests.support.tasks import create_task

BENCH_DB = "kb_bench_pipeline"
BATCH_SIZE = 32
MAX_TOKENS = 256
WORDS = [
    "refund",
    "order",
    "customer",
    "delivery",
    "invoice",
    "warranty",
    "return",
    "policy",
    "exchange",
    "receipt",
    "shipping",
    "carrier",
    "parcel",
    "damage",
    "replacement",
    "credit",
    "card",
    "account",
    "support",
    "ticket",
    "agent",
    "window",
    "days",
    "business",
    "weekend",
    "holiday",
    "region",
    "country",
    "tax",
    "duty",
    "customs",
    "fee",
    "charge",
]


async def recreate(admin_url: str, name: str = BENCH_DB) -> str:
    """The bench's database, created anew with our migrations; its URL."""
    return await recreate_database(admin_url, name, migrate=True)


def document(seed: int, sections: int, changed: int | None = None) -> bytes:
    """A Markdown policy of distinct sentences; ``changed`` rewrites one section."""
    parts = [f"# Policy {seed}"]
    for n in range(sections):
        words = [WORDS[(seed * 7 + n * 13 + k * k) % len(WORDS)] for k in range(60)]
        body = f"Clause {seed}.{n}: " + " ".join(words) + "."
        if n == changed:
            body = f"Clause {seed}.{n} was rewritten: refunds are no longer granted here."
        parts.append(f"## Section {n}\n\n{body}\n\n{body.upper()}")
    return "\n\n".join(parts).encode()


async def open_pool(url: str, size: int) -> asyncpg.Pool[Any]:
    return await create_pool(
        RuntimeSettings(database_url=url), min_size=1, max_size=size, reset=skip_session_reset
    )


# --- 1. efficiency -----------------------------------------------------------------------


async def bare_model_seconds(embedder: Embedder, texts: list[str]) -> float:
    started = time.perf_counter()
    for start in range(0, len(texts), BATCH_SIZE):
        await embedder.embed(texts[start : start + BATCH_SIZE])
    return time.perf_counter() - started


async def efficiency(url: str, documents: int, sections: int, slots: int) -> dict[str, Any]:
    embedder = OnnxLocalEmbedder()
    await embedder.warm_up()
    strategy = chunking_strategy(embedder, max_tokens=MAX_TOKENS)
    count = load_token_counter(strategy.tokenizer)
    contents = [document(seed, sections) for seed in range(documents)]
    chunking_started = time.perf_counter()
    texts = [
        chunk.embedding_input
        for content in contents
        for chunk in chunk_sections(
            parse_document("text/markdown", content),
            document_id=uuid.uuid4(),
            version_number=1,
            strategy=strategy,
            count_tokens=count,
        )
    ]
    chunking_seconds = time.perf_counter() - chunking_started
    await embedder.embed(texts[:BATCH_SIZE])  # warm
    limit_before = await bare_model_seconds(embedder, texts)

    pool = await open_pool(url, slots + 4)
    try:
        for content in contents:
            await create_task(pool, tenant_id="bench", content=content, media_type="text/markdown")
        signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
        indexer_parse = ParsePool(workers=slots)
        async with running_pipeline(
            pool,
            embedder=embedder,
            parse_pool=indexer_parse,
            max_tokens=MAX_TOKENS,
            batch_size=BATCH_SIZE,
        ) as indexer:
            # Warm parse processes (tokenizer loaded), as in a running `kb indexer run`.
            await asyncio.gather(
                *(
                    indexer_parse.parse_and_chunk(
                        "text/markdown",
                        document(10_000 + slot, 1),
                        document_id=uuid.uuid4(),
                        version_number=1,
                        strategy=strategy,
                    )
                    for slot in range(slots)
                )
            )
            worker = Worker(
                PgTaskQueue(pool),
                indexer,
                tier="standard",
                concurrency=slots,
                poll_interval_seconds=0.05,
                signals=signals,
            )
            stop = asyncio.Event()
            started = time.perf_counter()
            loop = asyncio.create_task(worker.run(stop))
            done = failed = 0
            while done + failed < documents:
                event = await signals.get()
                done += event.kind == "completed"
                failed += event.kind == "failed"
            pipeline_seconds = time.perf_counter() - started
            stop.set()
            await loop
        chunks = await pool.fetchval("SELECT count(*) FROM knowledge_chunk")
    finally:
        await pool.close()
    limit_after = await bare_model_seconds(embedder, texts)
    limit = (limit_before + limit_after) / 2
    return {
        "documents": documents,
        "failed": failed,
        "chunks": len(texts),
        "chunks_written": chunks,
        "slots": slots,
        "pipeline_seconds": pipeline_seconds,
        "pipeline_docs_per_s": documents / pipeline_seconds,
        "parse_chunk_seconds_inline": chunking_seconds,
        "limit_seconds_before": limit_before,
        "limit_seconds_after": limit_after,
        "limit_docs_per_s": documents / limit,
        "ratio": limit / pipeline_seconds,
    }


# --- 2. incremental ----------------------------------------------------------------------


async def add_version(
    pool: asyncpg.Pool[Any], tenant: str, document_id: uuid.UUID, content: bytes
) -> None:
    """Version 2 of a document and its task, as the publisher's publish leaves them."""
    import hashlib

    await pool.execute(
        """
        WITH version AS (
            INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                          media_type, sha256, size_bytes, status, published_at)
            VALUES ($1, $2, 2, $3, 'text/markdown', $4, $5, 'PUBLISHED', now())
        ), doc AS (
            UPDATE document SET latest_version = 2, published_version = 2, published_at = now()
             WHERE tenant_id = $1 AND document_id = $2
        )
        INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier)
        VALUES (gen_random_uuid(), $1, $2, 2, 'standard')
        """,
        tenant,
        document_id,
        content,
        hashlib.sha256(content).digest(),
        len(content),
    )


async def incremental(url: str) -> dict[str, Any]:
    recording = RecordingEmbedder(OnnxLocalEmbedder())
    pool = await open_pool(url, 6)
    try:
        created = await create_task(
            pool, tenant_id="incremental", content=document(1000, 200), media_type="text/markdown"
        )
        runs: dict[str, dict[str, float]] = {}
        async with running_pipeline(
            pool, embedder=recording, max_tokens=MAX_TOKENS, batch_size=BATCH_SIZE
        ) as indexer:
            worker = Worker(PgTaskQueue(pool), indexer, tier="standard", policy=RetryPolicy())
            for version in ("v1", "v2"):
                if version == "v2":
                    await add_version(
                        pool, "incremental", created.document_id, document(1000, 200, changed=117)
                    )
                recording.requests.clear()
                started = time.perf_counter()
                assert await worker.run_once() is RunOnceResult.SUCCEEDED
                runs[version] = {
                    "seconds": time.perf_counter() - started,
                    "requests": len(recording.requests),
                    "texts": len(recording.texts),
                }
        chunks = await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1 AND version_number = 2",
            created.document_id,
        )
    finally:
        await pool.close()
    return {"chunks": chunks, **runs, "time_ratio": runs["v2"]["seconds"] / runs["v1"]["seconds"]}


# --- 3. memory (in a child process of its own) -------------------------------------------


def rss_kib(pid: int | str, field: str = "VmRSS") -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except FileNotFoundError:
        return 0
    return 0


def big_text(megabytes: int) -> bytes:
    paragraphs = []
    size = 0
    n = 0
    while size < megabytes * 1024 * 1024:
        words = [WORDS[(n * 13 + k * k) % len(WORDS)] for k in range(30)]
        paragraph = f"Paragraph {n}: " + " ".join(words) + "."
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
        n += 1
    return "\n\n".join(paragraphs).encode()


def big_pdf(megabytes: int) -> bytes:
    """About ``megabytes`` of PDF: pages of text, each with an incompressible picture (a
    scanned or illustrated manual); the pictures make up most of the bytes."""
    import io

    import numpy as np
    from fpdf import FPDF
    from PIL import Image

    rng = np.random.default_rng(7)
    side = 300  # a 300x300 RGB noise PNG is about 270 KB
    pages = max(1, megabytes * 1024 * 1024 // (side * side * 3))
    pdf = FPDF()
    pdf.set_font("Helvetica", size=9)
    for page in range(pages):
        pdf.add_page()
        pdf.start_section(f"Part {page}", level=0)
        for line in range(30):
            words = [WORDS[(page * 7 + line * 13 + k * k) % len(WORDS)] for k in range(12)]
            pdf.cell(0, 5, f"{page}.{line} " + " ".join(words), new_x="LMARGIN", new_y="NEXT")
        picture = io.BytesIO()
        noise = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(noise, "RGB").save(picture, format="PNG")
        pdf.image(picture, x=10, y=170, w=80)
    return bytes(pdf.output())


async def create_big(url: str, kind: str, megabytes: int) -> tuple[uuid.UUID, int]:
    content = big_text(megabytes) if kind == "text" else big_pdf(megabytes)
    media_type = "text/plain" if kind == "text" else "application/pdf"
    pool = await open_pool(url, 2)
    try:
        created = await create_task(
            pool, tenant_id=f"memory-{kind}", content=content, media_type=media_type
        )
    finally:
        await pool.close()
    return created.task_id, len(content)


async def task_outcome(url: str, task_id: uuid.UUID) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    try:
        row = await conn.fetchrow(
            "SELECT t.status, t.error_code, (SELECT count(*) FROM knowledge_chunk c"
            "  WHERE c.document_id = t.document_id) AS chunks"
            "  FROM index_task t WHERE t.task_id = $1",
            task_id,
        )
    finally:
        await conn.close()
    assert row is not None
    return dict(row)


class ModelThenHashing:
    """The real ONNX model for the first ``model_texts`` texts, then the hashing embedder
    of the same dimension (the model's memory is all there; the hours are not)."""

    def __init__(self, model_texts: int) -> None:
        self.onnx = OnnxLocalEmbedder()
        self.fast = HashingEmbedder(dimension=self.onnx.dimension)
        self.left = model_texts
        self.model_texts = 0

    @property
    def model(self) -> str:
        return self.onnx.model

    @property
    def dimension(self) -> int:
        return self.onnx.dimension

    @property
    def tokenizer(self) -> TokenizerSpec:
        return self.onnx.tokenizer

    async def embed(self, texts: Sequence[str]) -> Vectors:
        if self.left > 0:
            self.left -= len(texts)
            self.model_texts += len(texts)
            return await self.onnx.embed(texts)
        return await self.fast.embed(texts)

    async def aclose(self) -> None:
        await self.onnx.aclose()


def memory_embedder(model: str, model_texts: int) -> Embedder:
    if model == "onnx":
        return OnnxLocalEmbedder()
    if model == "onnx-first":
        return ModelThenHashing(model_texts)
    return HashingEmbedder()


async def memory_child(url: str, model: str, model_texts: int) -> dict[str, Any]:
    """Index the one due task, as `kb indexer run` would; peaks read from /proc."""
    embedder = memory_embedder(model, model_texts)
    if isinstance(embedder, ModelThenHashing):
        await embedder.onnx.warm_up()
    elif isinstance(embedder, OnnxLocalEmbedder):
        await embedder.warm_up()
    loaded_kib = rss_kib("self")
    pool = await open_pool(url, 4)
    # A budget far above the default: this measures memory, not the parse time limit.
    parse_pool = ParsePool(workers=1, limits=ParseLimits(budget_seconds=3600))
    peaks = {"parser_kib": 0, "parser_hwm_kib": 0, "sum_kib": 0, "forkserver_kib": 0}
    stop = threading.Event()

    progress = f"/tmp/bench-pipeline-memory-{os.getpid()}.peaks"

    def sample() -> None:
        ticks = 0
        while not stop.wait(0.02):
            ticks += 1
            if ticks % 250 == 0:  # every ~5 s: the peaks so far, should the run be cut short
                with open(progress, "w") as out:
                    json.dump({**peaks, "indexer_hwm_kib": rss_kib("self", "VmHWM")}, out)
            workers = parse_pool.worker_pids()
            parser = sum(rss_kib(pid) for pid in workers)
            peaks["parser_kib"] = max(peaks["parser_kib"], parser)
            peaks["parser_hwm_kib"] = max(
                peaks["parser_hwm_kib"], sum(rss_kib(pid, "VmHWM") for pid in workers)
            )
            peaks["sum_kib"] = max(peaks["sum_kib"], parser + rss_kib("self"))
            for pid in workers:
                peaks["forkserver_kib"] = max(
                    peaks["forkserver_kib"], rss_kib(rss_kib(pid, "PPid"))
                )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        started = time.perf_counter()
        async with running_pipeline(
            pool, embedder=embedder, parse_pool=parse_pool, max_tokens=MAX_TOKENS
        ) as indexer:
            # Without the model's HNSW index: maintaining it for 100,000+ rows would take
            # the better part of an hour here, and it costs the database, not the indexer.
            await pool.execute(f'DROP INDEX IF EXISTS "{indexer.generation.ann_index_name}"')
            worker = Worker(PgTaskQueue(pool), indexer, tier="standard", lease_seconds=60)
            result = await worker.run_once()
        seconds = time.perf_counter() - started
    finally:
        stop.set()
        sampler.join()
        await pool.close()
    return {
        "model": embedder.model,
        "embedder": model,
        "model_texts": getattr(embedder, "model_texts", None),
        "result": str(result),
        "seconds": seconds,
        "indexer_after_model_load_mib": loaded_kib / 1024,
        "indexer_peak_mib": rss_kib("self", "VmHWM") / 1024,
        "parser_peak_mib": peaks["parser_hwm_kib"] / 1024,
        "parser_sampled_peak_mib": peaks["parser_kib"] / 1024,
        "sampled_sum_peak_mib": peaks["sum_kib"] / 1024,
        "forkserver_peak_mib": peaks["forkserver_kib"] / 1024,
    }


def memory(
    url: str, megabytes: int, model: str, model_texts: int, kinds: Sequence[str]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for kind in kinds:
        # Made here, not in the child: the child's peak is the indexer's alone.
        task_id, size = asyncio.run(create_big(url, kind, megabytes))
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.pipeline",
                "--memory-child",
                "--memory-embedder",
                model,
                "--memory-model-texts",
                str(model_texts),
                "--url",
                url,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        with open(f"/tmp/bench-pipeline-memory-{kind}.log", "w") as log:
            log.write(child.stderr)
        if child.returncode != 0:
            results.append({"kind": kind, "error": child.stderr[-2000:]})
            continue
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        outcome = asyncio.run(task_outcome(url, task_id))
        results.append({"kind": kind, "bytes": size, **measured, **outcome})
    return results


# --- report ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--sections", type=int, default=24)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--memory-mb", type=int, default=50)
    parser.add_argument(
        "--memory-embedder", choices=("onnx-first", "onnx", "hashing"), default="onnx-first"
    )
    parser.add_argument("--memory-model-texts", type=int, default=512)
    parser.add_argument("--memory-kinds", nargs="*", default=["pdf", "text"])
    parser.add_argument("--skip", nargs="*", default=[], choices=("efficiency", "incremental"))
    parser.add_argument("--database", default=BENCH_DB, help="scratch database (recreated)")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        configure_logging("info", "json", service="bench")
        result = asyncio.run(memory_child(args.url, args.memory_embedder, args.memory_model_texts))
        print(json.dumps(result))
        return

    configure_logging("warning", "json", service="bench")
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    url = asyncio.run(recreate(admin_url, args.database))
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    if "efficiency" not in args.skip:
        report["efficiency"] = asyncio.run(
            efficiency(url, args.documents, args.sections, args.slots)
        )
        print(json.dumps({"efficiency": report["efficiency"]}), flush=True)
    if "incremental" not in args.skip:
        report["incremental"] = asyncio.run(incremental(url))
        print(json.dumps({"incremental": report["incremental"]}), flush=True)
    if args.memory_mb:
        report["memory"] = memory(
            url, args.memory_mb, args.memory_embedder, args.memory_model_texts, args.memory_kinds
        )
        print(json.dumps({"memory": report["memory"]}), flush=True)


if __name__ == "__main__":
    main()
