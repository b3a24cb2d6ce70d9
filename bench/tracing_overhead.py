"""What tracing costs: indexing docs/s, and the indexer's CPU per document, and search p95
with tracing on (100 % sampling, every span exported over OTLP/HTTP to a receiver in
another process) and off, in the same run.

    uv run python -m bench.tracing_overhead --documents 1500 --rounds 4 --queries 500 \
        --sampled 0.1

Indexing: ``bench.indexing_throughput``'s run (the documents published as the publisher
writes them, one `kb indexer run` process, its provider the hashing stand-in behind the
OpenAI-compatible server, so the pipeline's own overhead is what is timed; ``--model onnx``:
the offline default model instead, what a deployment's documents cost), once per side
per round, each round in another order; each figure of a side is the median of its rounds.
The figures: docs/s over the whole run (from the process's start: its imports, the OTLP
exporter's among them, and connections are in it) and steady (from the first claim); the
indexer process's CPU milliseconds per document (its parse processes included), over the
whole run and steady, which the load of other processes changes far less than a rate.
``--sampled RATIO`` adds a third side, that share of traces sampled.

Search: ``Searcher`` over the corpus the last round indexed (the query's embedding a
fixed stand-in, so the database and the instrumented code are what is timed), in this
process, interleaved query by query: each query runs with tracing on and at once off,
alternating which goes first (the global tracer provider swapped between them). Vector,
keyword and hybrid; the figure is p95 on / p95 off.

Needs DATABASE_URL (or the dev stack: `kb dev up`). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from bench.indexing_throughput import (
    MODEL_NAME,
    TENANTS,
    corpus,
    publish,
    run_indexer,
    start_provider,
)
from bench.pipeline import recreate
from bench.search_scale_timing import percentile
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, Searcher, SearchMode, SearchRequest
from services.search.statements import SearchSettings

# A database of its own: the indexing bench's may be in use by another run.
BENCH_DB = "kb_bench_tracing"
# The collector stand-in: another process (decoding in this one would take the timed code's
# CPU and GIL), which reads each export and answers 200. HTTP/1.1, as a collector speaks:
# the exporter's connection is kept from one export to the next (HTTP/1.0 closed it after
# each, and a new connection for every export was a tenth of the traced side's extra CPU).
RECEIVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

WORDS = ("refund", "policy", "delivery", "order", "invoice", "return", "warranty", "days")


def start_collector() -> tuple[subprocess.Popen[str], str]:
    """The collector stand-in, started; its OTLP/HTTP traces URL."""
    collector = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True
    )
    assert collector.stdout is not None
    return collector, f"http://127.0.0.1:{collector.stdout.readline().strip()}/v1/traces"


# What one indexing run reports, by the name it has here.
INDEXING_FIGURES = {
    # Documents over the run's length, from the process's start (its imports and
    # connections included) until the last task finished.
    "docs_per_second": "docs_per_second",
    # From the first claim to the last completion: the rate of a running indexer.
    "docs_per_second_steady": "docs_per_second_steady",
    # The indexer process's CPU (with its parse processes) per document, start-up included
    # and, steady, from the first claim: robust to the load of other processes.
    "cpu_ms_per_document": "indexer_cpu_ms_per_document",
    "cpu_ms_per_document_steady": "indexer_steady_cpu_ms_per_document",
}


def side_env(receiver: str, sampled: float | None) -> dict[str, str]:
    """A traced side's variables: every span (``sampled`` None), or that share of the
    traces, head-sampled as an operator would (``traceidratio``: the attempts here have no
    stored parent; a published document's would carry its publish's decision)."""
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver, "OTEL_TRACES_SAMPLER": "always_on"}
    if sampled is not None:
        env.update(OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG=str(sampled))
    return env


async def index_once(
    url: str, documents: list[bytes], env: dict[str, str] | None, model: str
) -> dict[str, float]:
    """The figures of one `kb indexer run` over ``documents`` (traced with ``env``, if
    given), its provider ``model`` behind the OpenAI-compatible server."""
    await publish(url, documents)
    provider, base = start_provider(model, 8)
    try:
        run = await run_indexer(url, base, len(documents), 600, None, env)
    finally:
        provider.terminate()
        provider.wait(timeout=30)
    run["docs_per_second"] = run["succeeded"] / run["seconds"]
    run["docs_per_second_steady"] = run["succeeded"] / (
        run["seconds"] - (run["first_claim_seconds"] or 0.0)
    )
    return {name: float(run[key]) for name, key in INDEXING_FIGURES.items()}


class _Query:
    """The query's embedding: a fixed vector per text (the provider is not what is timed)."""

    model = MODEL_NAME
    dimension = 384
    tokenizer: Any = None

    async def embed(self, texts: list[str]) -> Any:
        rng = np.random.default_rng(abs(hash(texts[0])) % 2**32)
        vector = rng.standard_normal(384).astype(np.float32)
        return (vector / np.linalg.norm(vector)).reshape(1, -1)

    async def aclose(self) -> None:
        return None


async def search_interleaved(url: str, queries: int, receiver: str) -> dict[str, float]:
    """p95 on / off per mode, the sides interleaved query by query."""
    settings = SearchSettings(database_url=url, db_pool_min_size=2, db_pool_max_size=4)
    pool = await open_search_pool(settings)
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver)))
    try:
        await pool.execute(
            "INSERT INTO document_acl (tenant_id, document_id, principal, permission)"
            " SELECT tenant_id, document_id, 'group:all', 'READ' FROM document_search_version"
            " ON CONFLICT DO NOTHING"
        )
        index = PgSearchIndex(pool, Generation(MODEL_NAME, 384), settings)
        service = Searcher(_Query(), index)  # type: ignore[arg-type]
        rng = random.Random(11)
        ratios = {}
        for mode in (SearchMode.VECTOR, SearchMode.KEYWORD, SearchMode.HYBRID):
            times: dict[bool, list[float]] = {True: [], False: []}
            for n in range(queries):
                request = SearchRequest(
                    f"tenant-{rng.randrange(TENANTS)}",
                    " ".join(rng.sample(WORDS, 2)),
                    ("group:all",),
                    10,
                    mode,
                )
                for traced in (n % 2 == 0, n % 2 == 1):
                    trace._TRACER_PROVIDER = provider if traced else None
                    began = time.perf_counter()
                    await service.search(request)
                    times[traced].append(time.perf_counter() - began)
            trace._TRACER_PROVIDER = None
            ratios[mode.value] = percentile(times[True], 0.95) / percentile(times[False], 0.95)
            ratios[f"{mode.value}_p95_off_ms"] = percentile(times[False], 0.95) * 1000
        return ratios
    finally:
        trace._TRACER_PROVIDER = None
        provider.shutdown()
        await pool.close()


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    documents = corpus("documents", args.documents)
    collector, receiver = start_collector()
    sides: dict[str, dict[str, str] | None] = {"on": side_env(receiver, None), "off": None}
    if args.sampled is not None:
        sides["sampled"] = side_env(receiver, args.sampled)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    try:
        url = ""
        for round_ in range(args.rounds):
            # Each round in another order: no side always runs first (or last).
            names = list(sides)
            for side in names[round_ % len(names) :] + names[: round_ % len(names)]:
                url = await recreate(admin_url, BENCH_DB)
                runs[side].append(await index_once(url, documents, sides[side], args.model))
        search = {} if args.skip_search else await search_interleaved(url, args.queries, receiver)
    finally:
        collector.terminate()
        collector.wait(timeout=30)

    def over_off(side: str) -> dict[str, float]:
        """The median of the side's rounds over the median of the untraced: docs/s below 1
        and CPU above 1 is what tracing costs."""
        return {
            name: statistics.median(run[name] for run in runs[side])
            / statistics.median(run[name] for run in runs["off"])
            for name in INDEXING_FIGURES
        }

    result: dict[str, Any] = {
        "documents": len(documents),
        "model": args.model,
        "rounds": args.rounds,
        "indexing": {
            name: {side: [run[name] for run in runs[side]] for side in sides}
            for name in INDEXING_FIGURES
        },
        "indexing_on_over_off": over_off("on"),
    }
    if args.sampled is not None:
        result["sampled"] = args.sampled
        result["indexing_sampled_over_off"] = over_off("sampled")
    result["search_p95_on_over_off"] = search
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--skip-search", action="store_true", help="indexing alone")
    parser.add_argument(
        "--model",
        choices=["hashing", "onnx"],
        default="hashing",
        help="the indexer's provider: the hashing stand-in (the pipeline's own cost, the "
        "worst case for tracing's share) or the offline default model",
    )
    parser.add_argument(
        "--sampled",
        type=float,
        help="also index with this share of traces sampled (0.1: one in ten)",
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
