"""Publishing a backfill through the API: bulk requests against the single calls, same run.

    uv run python -m bench.bulk_publish --documents 5000 --batch 500

`kb serve` runs as its own process on a scratch database; a client (this process, 4
concurrent requests) publishes ``--documents`` ~1 KB text documents of the bench's corpus
with ``POST .../documents/bulk`` in batches of ``--batch``, then ``--single`` more through
the single calls (upload, then publish: two requests each). Reported: documents/s of each
and their ratio, and the bulk rate against the 1,000 documents/s target.

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.indexing_throughput import corpus, free_port
from bench.pipeline import recreate

BENCH_DB = "kb_bench_bulk_publish"
CONCURRENCY = 4


def kb(*args: str, env: dict[str, str]) -> str:
    command = [str(Path(sys.executable).with_name("kb")), *args]
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout


async def wait_ready(base: str) -> None:
    async with httpx.AsyncClient(base_url=base) as client:
        for _ in range(200):
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("kb serve did not get ready")


async def bulk_rate(
    client: httpx.AsyncClient, path: str, documents: list[bytes], batch: int
) -> float:
    """Documents/s from the first request to the last answer (each request's parts are
    built before the clock starts)."""
    gate = asyncio.Semaphore(CONCURRENCY)

    def parts(part: list[bytes]) -> list[tuple[str, Any]]:
        items = [{"title": f"Doc {n}", "acl": {"read": ["group:all"]}} for n in range(len(part))]
        files: list[tuple[str, Any]] = [("items", (None, json.dumps(items), "application/json"))]
        return files + [("file", (f"d{n}.txt", text, "text/plain")) for n, text in enumerate(part)]

    requests = [parts(documents[i : i + batch]) for i in range(0, len(documents), batch)]

    async def send(files: list[tuple[str, Any]]) -> None:
        async with gate:
            response = await client.post(path, files=files)
        response.raise_for_status()
        if response.json()["refused"]:
            raise SystemExit(f"items refused: {response.text[:500]}")

    began = time.perf_counter()
    await asyncio.gather(*(send(files) for files in requests))
    return len(documents) / (time.perf_counter() - began)


async def upload_and_publish(
    client: httpx.AsyncClient, path: str, file: tuple[str, bytes, str], title: str
) -> None:
    """One document as the API's two calls publish it: the upload, then its version 1
    published for group:all. ``path``: the tenant's documents; ``file``: name, bytes, type."""
    created = await client.post(path, files={"file": file}, data={"title": title})
    created.raise_for_status()
    body = created.json()
    published = await client.post(
        f"{path}/{body['documentId']}/versions/1/publish",
        json={"revision": body["revision"], "acl": {"read": ["group:all"]}},
    )
    published.raise_for_status()


async def single_rate(client: httpx.AsyncClient, path: str, documents: list[bytes]) -> float:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def send(n: int, text: bytes) -> None:
        async with gate:
            await upload_and_publish(client, path, (f"s{n}.txt", text, "text/plain"), "S")

    began = time.perf_counter()
    await asyncio.gather(*(send(n, text) for n, text in enumerate(documents)))
    return len(documents) / (time.perf_counter() - began)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    url = await recreate(admin_url, args.database)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(DATABASE_URL=url, KB_LOG_LEVEL="warning", KB_EMBEDDING_PROVIDER="hashing")
    key = re.search(
        r"KB_API_KEY=(\S+)", kb("tenants", "create", "bench", "--tier", "standard", env=env)
    )
    assert key is not None
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("kb")), "serve", "--port", str(port), env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(base)
        headers = {"Authorization": f"Bearer {key.group(1)}"}
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
            path = "/v1/tenants/bench/documents"
            bulk = await bulk_rate(
                client, f"{path}/bulk", corpus("documents", args.documents, seed=11), args.batch
            )
            single = await single_rate(client, path, corpus("documents", args.single, seed=12))
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 30)
    return {
        "documents": args.documents,
        "batch": args.batch,
        "bulk_docs_per_second": bulk,
        "single_docs_per_second": single,
        "bulk_over_single": bulk / single,
        "bulk_over_target_1000": bulk / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--single", type=int, default=500)
    parser.add_argument("--database", default=BENCH_DB)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
