"""Indexing throughput of `kb indexer run`, against the model's own rate in the same run.

    uv run python -m bench.indexing_throughput --corpus notes --model onnx
    uv run python -m bench.indexing_throughput --corpus documents --model hashing

What a user would measure: ``--documents`` documents of one corpus are published (rows
written as the publisher writes them, each with its PENDING task), then one
`kb indexer run` with default settings is started as a process, its embedding provider an
OpenAI-compatible server (``bench.throughput_provider``, a process of its own) running the
shipped int8 all-MiniLM-L6-v2 (``onnx``) or the hashing stand-in (``hashing``: the
pipeline's own overhead). Timed from the indexer's start until every task is SUCCEEDED.

Corpora, generated deterministically: ``notes``, short notes of about 600 characters;
``documents``, texts of about 1,250 characters in paragraphs.

The limit (``onnx``): the same inputs the server was sent, embedded by the bare model in
this process at each batch size of ``--bare-batches``, after the run; the best rate is the
model's own, and the pipeline's documents/s is reported as a share of it. The server's
busy share is the time it spent inside the model over the run's length.

The start, beside it: the rate from the first claim, and what any process pays before it
can claim (``process_start``): a fresh interpreter importing only the third-party modules
the indexer loads, then one importing the indexer's own modules as well.

Needs DATABASE_URL (or the dev stack: `kb dev up`). Uses its own database
(``--database``, recreated). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.pipeline import recreate
from tests.support.tasks import create_task

BENCH_DB = "kb_bench_throughput"
MODEL_NAME = "all-MiniLM-L6-v2-onnx-int8"
TENANTS = 4
WORDS = (
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
    "credit",
    "account",
    "payment",
    "balance",
    "discount",
    "voucher",
    "subscription",
    "renewal",
    "cancel",
    "notice",
    "period",
    "contract",
    "employee",
    "leave",
    "holiday",
    "manager",
    "approval",
    "expense",
    "travel",
    "hotel",
    "flight",
    "budget",
    "quarter",
    "report",
    "audit",
    "compliance",
    "privacy",
    "consent",
    "record",
    "retention",
    "archive",
    "backup",
    "access",
    "badge",
    "office",
    "desk",
    "meeting",
    "agenda",
)


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, characters: int) -> str:
    text = ""
    while len(text) < characters:
        text = f"{text} {sentence(rng)}".strip()
    return text


def markdown_note(number: int, rng: random.Random) -> str:
    """A short Markdown note: a title, then 1-3 paragraphs (whole sentences, past 100-320
    characters each), each after the first under a heading of its own half of the time."""
    parts = [f"# {' '.join(rng.choice(WORDS) for _ in range(3)).capitalize()} {number}"]
    for place in range(rng.randint(1, 3)):
        if place and rng.random() < 0.5:
            parts.append(f"## {' '.join(rng.choice(WORDS) for _ in range(2)).capitalize()}")
        parts.append(paragraph(rng, rng.randint(100, 320)))
    return "\n\n".join(parts) + "\n"


# The media type each corpus is published as.
MEDIA_TYPES = {"notes": "text/plain", "documents": "text/plain", "markdown-notes": "text/markdown"}


def corpus(kind: str, count: int, seed: int = 7) -> list[bytes]:
    """``notes``: one paragraph of ~600 characters; ``documents``: ~1,250 characters in
    paragraphs of ~300; ``markdown-notes``: LangChain's benchmark corpus's shape, short
    notes of ~580 characters in 1-3 paragraphs (``markdown_note``). Every document differs
    (no embedding is reused between them)."""
    rng = random.Random(seed)
    out = []
    for number in range(count):
        if kind == "markdown-notes":
            text = markdown_note(number, rng)
        elif kind == "notes":
            text = f"Note {number}. {paragraph(rng, 590)}\n"
        else:
            text = "\n\n".join(paragraph(rng, 280) for _ in range(4)) + "\n"
            text = f"Document {number}\n\n{text}"
        out.append(text.encode())
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_provider(
    model: str, inference_batch: int, threads: int = 2, runs: int = 1
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.throughput_provider",
            "--port",
            str(port),
            "--model",
            model,
            "--inference-batch",
            str(inference_batch),
            "--model-threads",
            str(threads),
            "--runs-at-once",
            str(runs),
        ]
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/stats", timeout=1).raise_for_status()
            return process, base
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the bench provider did not start")


def indexer_env(url: str, provider: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    from services.embedding.onnx_local import default_tokenizer_file

    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(
        DATABASE_URL=url,
        KB_LOG_LEVEL="warning",
        KB_EMBEDDING_PROVIDER="openai",
        KB_EMBEDDING_BASE_URL=f"{provider}/v1",
        KB_EMBEDDING_MODEL=MODEL_NAME,
        KB_EMBEDDING_DIMENSIONS="384",
        KB_EMBEDDING_TOKENIZER_FILE=str(default_tokenizer_file()),
        KB_EMBEDDING_MAX_INPUT_TOKENS="256",
    )
    env.update(extra or {})
    return env


async def publish(url: str, documents: list[bytes], media_type: str = "text/plain") -> None:
    pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
    try:
        for number, content in enumerate(documents):
            await create_task(
                pool,
                tenant_id=f"tenant-{number % TENANTS}",
                content=content,
                media_type=media_type,
            )
    finally:
        await pool.close()


async def progress(conn: asyncpg.Connection[Any]) -> tuple[int, int, int]:
    row = await conn.fetchrow(
        """SELECT count(*) FILTER (WHERE status = 'SUCCEEDED') AS done,
                  count(*) FILTER (WHERE status = 'DEAD') AS dead,
                  count(*) FILTER (WHERE status <> 'PENDING') AS started
             FROM index_task"""
    )
    assert row is not None
    return row["done"], row["dead"], row["started"]


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` and of its descendants, live or reaped (the indexer
    and its parse processes), so far; from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    # Fields 14-17 of proc(5), utime, stime, cutime, cstime; [0] here is field 3.
    own = sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return own + sum(process_tree_cpu_seconds(int(child)) for child in children)


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def postgres_cpu_reader(conn: asyncpg.Connection[Any]) -> Path | None:
    """/proc/<postmaster>/stat when the server runs on this machine (the dev stack), else
    None: its cutime + cstime grow by the CPU time of every backend that exits, so the
    indexer's backends are counted once its pool has closed."""
    return postmaster_stat(await conn.fetchval("SELECT pg_backend_pid()"))


def postmaster_stat(backend: int) -> Path | None:
    try:
        status = Path(f"/proc/{backend}/status").read_text()
    except OSError:
        return None
    parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
    return Path(f"/proc/{parent}/stat")


def reaped_cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rpartition(")")[2].split()
    # Fields 16 and 17 of proc(5), cutime and cstime; [0] here is field 3.
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


async def run_indexer(
    url: str,
    provider: str,
    count: int,
    limit_seconds: float,
    profile: str | None = None,
    settings: dict[str, str] | None = None,
) -> dict[str, Any]:
    kb = Path(sys.executable).with_name("kb")
    conn = await asyncpg.connect(url)
    try:
        postgres_stat = await postgres_cpu_reader(conn)
        postgres_before = reaped_cpu_seconds(postgres_stat) if postgres_stat else 0.0
        indexer_before = children_cpu_seconds()
        started = time.monotonic()
        started_at = time.time()  # the database's clock: this machine's, as finished_at's
        command = [str(kb), "indexer", "run", "--tier", "standard", "--no-hints"]
        process = await asyncio.create_subprocess_exec(
            *command, env=indexer_env(url, provider, settings)
        )
        profiler = None
        first_claim: float | None = None
        done = dead = 0
        # The indexer's CPU from its first claim until its last task finished: what each
        # document costs once running, start-up (imports, connections) left out.
        steady_cpu: list[float] = []
        try:
            if profile:
                # py-spy (pip install py-spy): collapsed stacks of the indexer, for flame graphs.
                profiler = await asyncio.create_subprocess_exec(
                    "py-spy",
                    "record",
                    "-f",
                    "raw",
                    "-r",
                    "100",
                    "-o",
                    profile,
                    "-p",
                    str(process.pid),
                )
            while time.monotonic() - started < limit_seconds:
                done, dead, begun = await progress(conn)
                now = time.monotonic()
                if first_claim is None and begun:
                    first_claim = now - started
                    steady_cpu.append(process_tree_cpu_seconds(process.pid))
                if done + dead >= count:
                    steady_cpu.append(process_tree_cpu_seconds(process.pid))
                    break
                if process.returncode is not None:
                    raise SystemExit(f"kb indexer run exited with {process.returncode}")
                # Fine until the first claim (its time is reported); then coarse, so the
                # count over index_task takes little of the CPU the run is measured on.
                await asyncio.sleep(0.02 if first_claim is None else 0.1)
        finally:
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                await asyncio.wait_for(profiler.wait(), 60)
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)
        indexer_cpu = children_cpu_seconds() - indexer_before
        await asyncio.sleep(0.5)  # the postmaster reaps the indexer's backends
        postgres_cpu = (
            reaped_cpu_seconds(postgres_stat) - postgres_before if postgres_stat else None
        )
        span = await conn.fetchrow(
            "SELECT extract(epoch FROM max(finished_at) - min(finished_at)) AS steady,"
            " extract(epoch FROM max(finished_at)) AS last"
            " FROM index_task WHERE status IN ('SUCCEEDED', 'DEAD')"
        )
        chunks = await conn.fetchval("SELECT count(*) FROM knowledge_chunk")
        assert span is not None
        # From the start until the last task finished, by the tasks' own times: not rounded up
        # to the next poll.
        last = span["last"]
        elapsed = time.monotonic() - started if last is None else float(last) - started_at
    finally:
        await conn.close()
    return {
        "succeeded": done,
        "dead": dead,
        "seconds": elapsed,
        "first_claim_seconds": first_claim,
        "first_to_last_completion_seconds": float(span["steady"] or 0.0),
        # CPU time per document, which a loaded machine changes far less than the rate:
        # the indexer process (start-up included) and the database's backends.
        "indexer_cpu_ms_per_document": 1000 * indexer_cpu / max(1, done),
        "indexer_steady_cpu_ms_per_document": (
            1000 * (steady_cpu[-1] - steady_cpu[0]) / max(1, done) if len(steady_cpu) == 2 else None
        ),
        "postgres_cpu_ms_per_document": (
            None if postgres_cpu is None else 1000 * postgres_cpu / max(1, done)
        ),
        "chunks": chunks,
    }


async def database_floor(url: str) -> dict[str, float]:
    """The least the database itself takes to hold what the run wrote: the run's chunk
    rows, into the emptied table (its HNSW, full-text and btree indexes kept, as the run
    started), COPYed back one transaction per document as the pipeline commits them, and
    then all in one transaction, as a batch loader with no per-document promise would.
    Documents/s of each: a ceiling no pipeline on this database can pass."""
    from services.indexer.sink.write import INDEX_COLUMNS
    from services.runtime.pg.db import create_pool
    from services.runtime.settings import RuntimeSettings

    pool = await create_pool(
        RuntimeSettings(database_url=url, kafka_bootstrap_servers="127.0.0.1:1"),
        min_size=1,
        max_size=1,
    )
    try:
        columns = list(INDEX_COLUMNS)  # what the sink COPYs
        rows = await pool.fetch(
            f"SELECT {', '.join(columns)} FROM knowledge_chunk ORDER BY document_id, ordinal"
        )
        by_document: dict[Any, list[tuple[Any, ...]]] = {}
        for row in rows:
            by_document.setdefault(row["document_id"], []).append(
                tuple(row[column] for column in columns)
            )
        rates = {}
        async with pool.acquire() as conn:
            for name in ("per_document", "one_batch"):
                await conn.execute("TRUNCATE knowledge_chunk")
                started = time.perf_counter()
                if name == "per_document":
                    for records in by_document.values():
                        async with conn.transaction():
                            await conn.copy_records_to_table(
                                "knowledge_chunk", records=records, columns=columns
                            )
                else:
                    async with conn.transaction():
                        await conn.copy_records_to_table(
                            "knowledge_chunk",
                            records=[record for chunk in by_document.values() for record in chunk],
                            columns=columns,
                        )
                rates[name] = len(by_document) / (time.perf_counter() - started)
        return rates
    finally:
        await pool.close()


# What `kb indexer run` imports before its first claim (and the HTTP client's asyncio
# backend, which it imports at its first request).
INDEXER_MODULES = (
    "services.cli",
    "services.indexer.cli",
    "services.indexer.wiring",
    "services.embedding.openai_http",
    "anyio._backends._asyncio",
)


def importing(names: Sequence[str]) -> str:
    """Code that imports ``names``, in order."""
    return f"import importlib\nfor name in {tuple(names)!r}: importlib.import_module(name)\n"


def process_start() -> dict[str, float]:
    """The least a process pays before it can claim: a fresh interpreter importing only the
    third-party modules the indexer loads (``libraries_seconds``: the floor of any indexer
    written on these libraries), and importing the indexer's own modules as well
    (``indexer_seconds``); the best of three spawns each."""
    listing = subprocess.run(
        [
            sys.executable,
            "-c",
            importing(INDEXER_MODULES) + "import sys, sysconfig\n"
            "site = sysconfig.get_paths()['purelib']\n"
            "print(' '.join(sorted(n for n, m in list(sys.modules.items())"
            " if (getattr(m, '__file__', None) or '').startswith(site))))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()

    def best(code: str) -> float:
        times = []
        for _ in range(3):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - began)
        return min(times)

    return {
        "libraries_seconds": best(importing(listing)),
        "indexer_seconds": best(importing(INDEXER_MODULES)),
    }


async def bare_model(inputs: list[str], batches: list[int]) -> dict[int, float]:
    """Seconds the bare model takes for ``inputs`` at each batch size, one request at a
    time, the model's own sorted, padded runs of the whole batch."""
    from services.embedding.onnx_local import OnnxLocalEmbedder

    seconds = {}
    for batch in batches:
        model = OnnxLocalEmbedder(inference_batch_size=batch)
        await model.embed(inputs[:batch])  # loaded and warm
        began = time.perf_counter()
        for start in range(0, len(inputs), batch):
            await model.embed(inputs[start : start + batch])
        seconds[batch] = time.perf_counter() - began
        await model.aclose()
    return seconds


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    url = await recreate(admin_url, args.database)
    documents = corpus(args.corpus, args.documents)
    await publish(url, documents, MEDIA_TYPES[args.corpus])
    provider, base = start_provider(args.model, args.inference_batch)
    try:
        settings = dict(item.split("=", 1) for item in args.set)
        run = await run_indexer(url, base, len(documents), args.timeout, args.profile, settings)
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            stats = (await client.get("/stats")).json()
            inputs: list[str] = (await client.get("/inputs")).json()
    finally:
        provider.terminate()
        provider.wait(timeout=30)
    result: dict[str, Any] = {
        "corpus": args.corpus,
        "model": args.model,
        "documents": len(documents),
        "mean_characters": sum(map(len, documents)) / len(documents),
        **run,
        "docs_per_second": run["succeeded"] / run["seconds"],
        "requests": stats["requests"],
        "inputs": stats["inputs"],
        "inputs_per_request": stats["inputs"] / max(1, stats["requests"]),
        "model_busy_seconds": stats["busy_seconds"],
        "model_busy_share": stats["busy_seconds"] / run["seconds"],
    }
    if run["first_claim_seconds"] is not None:
        result["docs_per_second_from_first_claim"] = run["succeeded"] / (
            run["seconds"] - run["first_claim_seconds"]
        )
    result["process_start_seconds"] = process_start()
    floor = await database_floor(url)
    result.update(
        database_floor_docs_per_second=floor,
        share_of_database_floor=result["docs_per_second"] / floor["per_document"],
    )
    if args.model == "onnx":
        bare = await bare_model(inputs, args.bare_batches)
        best_batch = min(bare, key=lambda batch: bare[batch])
        bare_rate = len(documents) / bare[best_batch]
        result.update(
            bare_seconds_by_batch={str(k): round(v, 3) for k, v in bare.items()},
            bare_best_batch=best_batch,
            bare_docs_per_second=bare_rate,
            share_of_bare_model=result["docs_per_second"] / bare_rate,
        )
    else:
        result["share_of_library_rate_400"] = result["docs_per_second"] / 400
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", choices=sorted(MEDIA_TYPES), default="notes")
    parser.add_argument("--model", choices=["onnx", "hashing"], default="onnx")
    parser.add_argument("--documents", type=int, default=500)
    parser.add_argument("--database", default=BENCH_DB)
    parser.add_argument("--inference-batch", type=int, default=8)
    parser.add_argument("--bare-batches", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--profile", help="record the indexer with py-spy into this file")
    parser.add_argument(
        "--set", action="append", default=[], help="KB_...=value for the indexer (repeatable)"
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
