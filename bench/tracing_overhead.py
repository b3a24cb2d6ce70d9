"""What tracing costs: indexing docs/s and search p95 with tracing on (100 % sampling,
every span exported over OTLP/HTTP to a receiver in another process) and off, in the same
run.

    uv run python -m bench.tracing_overhead --documents 300 --rounds 2 --queries 400

Indexing: ``bench.indexing_throughput``'s run (the documents published as the publisher
writes them, one `kb indexer run` process, its provider the hashing stand-in behind the
OpenAI-compatible server, so the pipeline's own overhead is what is timed), once per side
per round, the sides alternating which goes first; docs/s of each side is the median of its
rounds.

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
# CPU and GIL), which reads each export and answers 200.
RECEIVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
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


async def index_once(url: str, documents: list[bytes], receiver: str | None) -> float:
    """docs/s of one `kb indexer run` over ``documents`` (tracing on when ``receiver``)."""
    await publish(url, documents)
    provider, base = start_provider("hashing", 8)
    extra = {}
    if receiver is not None:
        extra = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver,
            "OTEL_TRACES_SAMPLER": "always_on",
        }
    try:
        run = await run_indexer(url, base, len(documents), 600, None, extra)
    finally:
        provider.terminate()
        provider.wait(timeout=30)
    return float(run["succeeded"] / run["seconds"])


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
    rates: dict[bool, list[float]] = {True: [], False: []}
    collector, receiver = start_collector()
    try:
        url = ""
        for round_ in range(args.rounds):
            for traced in (round_ % 2 == 0, round_ % 2 == 1):
                url = await recreate(admin_url, BENCH_DB)
                rates[traced].append(await index_once(url, documents, receiver if traced else None))
        search = await search_interleaved(url, args.queries, receiver)
    finally:
        collector.terminate()
        collector.wait(timeout=30)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    return {
        "documents": len(documents),
        "rounds": args.rounds,
        "indexing_docs_per_second": {"on": rates[True], "off": rates[False]},
        "indexing_on_over_off": on / off,
        "search_p95_on_over_off": search,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queries", type=int, default=400)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
