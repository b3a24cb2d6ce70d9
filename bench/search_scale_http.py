"""The HTTP rows of ``bench.search_latency``: ``kb serve`` started as a user starts it (the
``kb`` script of this environment, DATABASE_URL pointing at the bench database, the default
embedder: the offline ONNX model), searched with the bench tenants' keys at concurrency 1
and 8, and its resident memory: RSS once ready, and the peak (the kernel's VmHWM) after
the HTTP rows."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.search_scale_corpus import Query, tenant_name
from bench.search_scale_load import api_key
from bench.search_scale_timing import TOP_K, Row, timed
from services.search.searcher import SearchMode

PRINCIPALS = "typical"
READY_TIMEOUT_SECONDS = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def kb_script() -> str:
    found = shutil.which("kb") or str(Path(sys.executable).with_name("kb"))
    if not Path(found).exists():
        raise RuntimeError("the kb script is not installed in this environment (uv sync)")
    return found


def rss_bytes(pid: int, field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


async def wait_ready(client: httpx.AsyncClient, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"kb serve exited with {process.returncode}")
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("kb serve was not ready in time")


async def http_measure(
    url: str, queries: list[Query], concurrency: list[int], log: Callable[[str], None]
) -> tuple[list[Row], dict[str, Any]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_EMBEDDING_")}
    env["DATABASE_URL"] = url
    log_path = Path(tempfile.gettempdir()) / f"kb-serve-bench-{port}.log"
    with log_path.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            kb_script(),
            "serve",
            "--port",
            str(port),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
        )
    log(f"kb serve pid {process.pid} on port {port}, log {log_path}")
    try:
        return await _measure(process, port, queries, concurrency, log)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _measure(
    process: asyncio.subprocess.Process,
    port: int,
    queries: list[Query],
    concurrency: list[int],
    log: Callable[[str], None],
) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    memory: dict[str, Any] = {"embedder": "default embedder: the offline ONNX model"}
    limits = httpx.Limits(max_connections=max(concurrency))
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60
    ) as client:
        await wait_ready(client, process)
        memory["ready_rss"] = rss_bytes(process.pid, "VmRSS")
        for mode in (SearchMode.VECTOR, SearchMode.KEYWORD, SearchMode.HYBRID):
            # Each principal set's vector path kept (KB_SEARCH_PATH_CACHE_SECONDS, 30 s), as
            # the in-process rows have it (prime_paths): each mode's rows measure principals
            # who searched a moment ago (the first mode's used to pay every count).
            for n in range(len(queries)):
                await search(client, queries[n], SearchMode.VECTOR, top_k=1)

            async def call(n: int, mode: SearchMode = mode) -> Any:
                return await search(client, queries[n], mode)

            for c in concurrency:
                samples, answers, rate, _ = await timed(call, len(queries), c)
                row = Row(
                    f"HTTP kb serve {mode.value} (embedding incl.)",
                    PRINCIPALS,
                    c,
                    samples,
                    rate,
                )
                row.extra["mean results"] = sum(len(a["results"]) for a in answers) / len(answers)
                rows.append(row)
                log(f"{row.name} c{c}: {rate:.0f}/s")
        memory["peak_rss"] = rss_bytes(process.pid, "VmHWM")
    return rows, memory


async def search(
    client: httpx.AsyncClient, query: Query, mode: SearchMode, top_k: int = TOP_K
) -> Any:
    """One search of ``query`` through the API, as the bench tenant's key."""
    tenant = tenant_name(query.tenant)
    response = await client.post(
        f"/v1/tenants/{tenant}/search",
        headers={"Authorization": f"Bearer {api_key(tenant)}"},
        json={
            "query": query.text,
            "topK": top_k,
            "principals": list(query.principals(PRINCIPALS)),
            "mode": mode.value,
        },
    )
    if response.status_code != 200:
        raise RuntimeError(f"search answered {response.status_code}: {response.text}")
    answer = response.json()
    if answer.get("degraded"):
        # A keyword-only answer is fast because it skipped the query embedding: not a result.
        raise RuntimeError(
            f"search answered degraded ({answer['degraded']}): the query model timed out"
        )
    return answer
