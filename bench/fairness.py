"""Fair shares (issue 29): does one tenant's flood of searches slow another tenant down?

    uv run python -m bench.fairness --chunks 50000 --flood-seconds 30 --flooders 20

``kb serve`` is started as a user starts it (``python -m services.cli serve``, the default
embedder: the offline ONNX model) on a database of its own holding the corpus of
``bench/search_scale_corpus.py`` (100 tenants; loaded once, reused by later runs). For
each configuration -- fair shares on (the defaults, or ``--fair-env``) and off
(``KB_FAIR_ENABLED=false``, the peer) -- a fresh process is started and:

1. tenant B (``t001``) searches alone, one hybrid search at a time (topK 10, a typical
   user's principals): its solo p50;
2. tenant A (``t000``) floods: ``--flooders`` clients each sending its next search the
   moment the last one is answered, ignoring Retry-After (a 429 is counted and sent
   again), for ``--flood-seconds``; meanwhile B searches as in 1, from the second
   ``--ramp-seconds`` on: its p50 under the flood;
3. after the cycles, A floods one more window with B idle: what a tenant alone gets at
   saturation, which the search slots trade for the other tenants' latency.

Printed: per configuration B's p50 / p95 solo and under the flood and their ratio (the
target: at most 1.5x with fair shares on), A's answers per second, its 429s and p50 beside
B, and A's answers per second alone.
Other processes on the machine move these figures: run it more than once.
Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.databases import url_for
from bench.search_latency import MODEL
from bench.search_scale_corpus import Query, build_corpus, build_queries, tenant_name
from bench.search_scale_http import free_port, wait_ready
from bench.search_scale_load import api_key, corpus_identity, load, migrate, reusable

REPO = Path(__file__).resolve().parents[1]
PRINCIPALS = "typical"
TOP_K = 10
FLOODER, QUIET = 0, 1  # tenants t000 and t001


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Figures:
    name: str
    solo_ms: list[float] = field(default_factory=list)
    flooded_ms: list[float] = field(default_factory=list)
    flood_answers: Counter[int] = field(default_factory=Counter)
    flood_ok_ms: list[float] = field(default_factory=list)
    flood_seconds: float = 0.0
    # Tenant A flooding with B idle: what a tenant alone gets at saturation.
    alone_answers: int = 0
    alone_seconds: float = 0.0
    degraded: int = 0

    def row(self) -> str:
        solo, flooded = statistics.median(self.solo_ms), statistics.median(self.flooded_ms)
        ok = self.flood_answers[200]
        return (
            f"| {self.name} | {solo:.1f} / {percentile(self.solo_ms, 0.95):.1f} "
            f"| {flooded:.1f} / {percentile(self.flooded_ms, 0.95):.1f} "
            f"| **{flooded / solo:.2f}x** | {len(self.flooded_ms)} "
            f"| {ok / self.flood_seconds:.0f} "
            f"| {statistics.median(self.flood_ok_ms) if self.flood_ok_ms else 0:.0f} "
            f"| {self.flood_answers[429]} | {self.alone_answers / self.alone_seconds:.0f} "
            f"| {self.degraded} |"
        )


def body(query: Query) -> dict[str, Any]:
    """A hybrid search (the default mode) of ``query`` as a typical user."""
    return {"query": query.text, "topK": TOP_K, "principals": list(query.principals(PRINCIPALS))}


class Api:
    def __init__(self, client: httpx.AsyncClient, queries: list[Query]) -> None:
        self.client = client
        self.queries = queries
        self.degraded = 0

    async def search(self, tenant: int, n: int) -> tuple[int, float]:
        """One hybrid search as ``tenant``: its status and milliseconds."""
        query = self.queries[n % len(self.queries)]
        name = tenant_name(tenant)
        started = time.perf_counter()
        response = await self.client.post(
            f"/v1/tenants/{name}/search",
            headers={"Authorization": f"Bearer {api_key(name)}"},
            json=body(query),
        )
        elapsed = (time.perf_counter() - started) * 1000
        if response.status_code == 200 and response.json().get("degraded"):
            self.degraded += 1
        elif response.status_code not in (200, 429):
            raise RuntimeError(f"search answered {response.status_code}: {response.text}")
        return response.status_code, elapsed

    async def quiet_searches_for(self, seconds: float, start: int) -> list[float]:
        """Tenant B's searches, one at a time, for ``seconds``."""
        samples = []
        deadline = time.perf_counter() + seconds
        n = start
        while time.perf_counter() < deadline:
            status, elapsed = await self.search(QUIET, n)
            if status != 200:
                raise RuntimeError(f"the quiet tenant was answered {status}")
            samples.append(elapsed)
            n += 1
        return samples


async def measure(
    url: str, name: str, env_overrides: dict[str, str], args: argparse.Namespace
) -> Figures:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_EMBEDDING_", "KB_FAIR_"))}
    env.update(DATABASE_URL=url, PYTHONPATH=str(REPO), **env_overrides)
    log_path = Path(tempfile.gettempdir()) / f"kb-serve-fairness-{port}.log"
    with log_path.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--port",
            str(port),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
        )
    log(f"{name}: kb serve pid {process.pid} on port {port} ({env_overrides}), log {log_path}")
    try:
        limits = httpx.Limits(max_connections=args.flooders + 4)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=120
        ) as client:
            await wait_ready(client, process)
            return await _phases(Api(client, build_queries(args.corpus, 500)), port, name, args)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _phases(api: Api, port: int, name: str, args: argparse.Namespace) -> Figures:
    """Solo and flood windows in turn, so that the load other processes put on the machine
    weighs on both figures alike."""
    figures = Figures(name)
    # Warm up both tenants' paths, caches and the query model.
    for n in range(30):
        await api.search(QUIET, n)
        await api.search(FLOODER, n)
    n = 0
    for cycle in range(args.cycles):
        solo = await api.quiet_searches_for(args.solo_seconds, n)
        n += len(solo)
        figures.solo_ms += solo
        flood = await _start_flood(port, args)
        await asyncio.sleep(args.ramp_seconds)
        flooded = await api.quiet_searches_for(args.window_seconds - args.ramp_seconds, n)
        n += len(flooded)
        figures.flooded_ms += flooded
        result = await _flood_result(flood)
        figures.flood_answers.update({int(k): v for k, v in result["answers"].items()})
        figures.flood_ok_ms += result["ok_ms"]
        figures.flood_seconds += result["seconds"]
        log(
            f"{name} cycle {cycle + 1}: B solo p50 {statistics.median(solo):.1f} ms, "
            f"flooded {statistics.median(flooded):.1f} ms; A {result['answers']}"
        )
    # A alone, one window: its answers a second at saturation, which slots cost.
    alone = await _flood_result(await _start_flood(port, args))
    figures.alone_answers = alone["answers"].get("200", 0)
    figures.alone_seconds = alone["seconds"]
    log(f"{name} A alone: {alone['answers']} in {alone['seconds']:.1f} s")
    figures.degraded = api.degraded
    return figures


async def _start_flood(port: int, args: argparse.Namespace) -> asyncio.subprocess.Process:
    """Tenant A's flood for one window, in a process of its own; returns once it started."""
    flood = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.fairness",
        "--flood-port",
        str(port),
        "--flooders",
        str(args.flooders),
        "--flood-seconds",
        str(args.window_seconds),
        "--flood-queries",
        str(args.queries_file),
        stdout=asyncio.subprocess.PIPE,
    )
    assert flood.stdout is not None
    await flood.stdout.readline()  # "started"
    return flood


async def _flood_result(flood: asyncio.subprocess.Process) -> dict[str, Any]:
    assert flood.stdout is not None
    result: dict[str, Any] = json.loads(await flood.stdout.read())
    await flood.wait()
    return result


async def flood(port: int, flooders: int, seconds: float, queries_file: Path) -> None:
    """Tenant A's clients, in a process of their own (their HTTP work must not delay B's
    timing in the measuring process): each sends its next search the moment the last one
    is answered, a 429 as well. Prints "started", then the answers as JSON."""
    answers: Counter[int] = Counter()
    ok_ms: list[float] = []
    queries: list[dict[str, Any]] = json.loads(await asyncio.to_thread(queries_file.read_text))
    limits = httpx.Limits(max_connections=flooders)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=120
    ) as client:
        name = tenant_name(FLOODER)
        headers = {"Authorization": f"Bearer {api_key(name)}"}
        deadline = time.perf_counter() + seconds

        async def client_loop(worker: int) -> None:
            n = worker * 10
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                response = await client.post(
                    f"/v1/tenants/{name}/search", headers=headers, json=queries[n % len(queries)]
                )
                answers[response.status_code] += 1
                if response.status_code == 200:
                    ok_ms.append((time.perf_counter() - started) * 1000)
                n += 1

        started = time.perf_counter()
        print("started", flush=True)
        await asyncio.gather(*(client_loop(w) for w in range(flooders)))
    result = {"answers": answers, "ok_ms": ok_ms, "seconds": time.perf_counter() - started}
    print(json.dumps(result), flush=True)


async def run(args: argparse.Namespace) -> int:
    if args.flood_port:
        await flood(args.flood_port, args.flooders, args.flood_seconds, args.flood_queries)
        return 0
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    database = args.database or f"kb_bench_fairness_{args.chunks // 1000}k"
    args.corpus = corpus = build_corpus(args.chunks, args.seed, "clustered")
    why = await reusable(admin_url, database, corpus_identity(corpus, MODEL))
    if why is None:
        url = url_for(admin_url, database)
        log(f"reusing {database}")
        await migrate(url)
    else:
        log(f"loading {database} ({why})")
        url = await load(
            admin_url,
            database,
            corpus,
            MODEL,
            maintenance_work_mem="1GB",
            parallel_workers=2,
            log=log,
        )
    args.queries_file = Path(tempfile.gettempdir()) / f"kb-fairness-queries-{os.getpid()}.json"
    await asyncio.to_thread(
        args.queries_file.write_text,
        json.dumps([body(query) for query in build_queries(corpus, 500)]),
    )
    fair_env = dict(item.split("=", 1) for item in args.fair_env)
    configurations = [("fair shares on", {"KB_FAIR_ENABLED": "true", **fair_env})]
    if args.peer:
        configurations.append(("fair shares off (peer)", {"KB_FAIR_ENABLED": "false"}))
    rows = [await measure(url, name, env, args) for name, env in configurations]
    print(
        f"\nTenant B's hybrid search, one at a time, alone and while tenant A floods with "
        f"{args.flooders} clients, {args.cycles} windows of {args.window_seconds:.0f} s "
        f"between solo windows of {args.solo_seconds:.0f} s ({args.chunks} chunks, "
        f"100 tenants; fair-share settings: {fair_env or 'defaults'})\n"
    )
    print(
        "| configuration | B solo p50 / p95 ms | B under flood p50 / p95 ms | ratio of p50s "
        "| B searches under flood | A answers/s | A p50 ms | A 429s | A alone answers/s "
        "| degraded answers |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for figures in rows:
        print(figures.row())
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--database", help="default: kb_bench_fairness_<chunks/1000>k")
    parser.add_argument("--flooders", type=int, default=20)
    parser.add_argument(
        "--flood-seconds", type=float, default=30.0, help="of flood, over all the cycles"
    )
    parser.add_argument("--cycles", type=int, default=3, help="solo and flood windows in turn")
    parser.add_argument("--solo-seconds", type=float, default=5.0, help="per cycle")
    parser.add_argument(
        "--ramp-seconds", type=float, default=1.0, help="of each flood window, not measured"
    )
    # The flood process's own arguments.
    parser.add_argument("--flood-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--flood-queries", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-peer", dest="peer", action="store_false", help="skip the fair-shares-off run"
    )
    parser.add_argument(
        "--fair-env",
        nargs="*",
        default=[],
        metavar="KB_FAIR_X=V",
        help="settings of the fair-shares-on run (default: the defaults)",
    )
    args = parser.parse_args()
    args.window_seconds = args.flood_seconds / args.cycles
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
