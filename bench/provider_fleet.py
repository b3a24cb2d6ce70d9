"""What the provider benchmarks share: a scratch database with a tenant, the test provider
as a process, and `kb` processes (API, indexers) pointed at it.

Not part of the test suite: `bench.provider_quota` and `bench.provider_outage` use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.indexing_throughput import free_port
from bench.pipeline import recreate
from tests.support.embedding_provider import ProviderProcess, start_provider_process

MODEL = "bench-embedding-model"
TENANT = "bench"


def kb_path() -> str:
    return str(Path(sys.executable).with_name("kb"))


class Fleet:
    """One scratch database, one test provider, and the `kb` processes started against them."""

    def __init__(self, url: str, provider: ProviderProcess, key: str) -> None:
        self.url = url
        self.provider = provider
        self.key = key
        self.processes: list[asyncio.subprocess.Process] = []

    @classmethod
    async def create(cls, database: str) -> Fleet:
        admin_url = os.environ.get("DATABASE_URL")
        if not admin_url:
            raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
        url = await recreate(admin_url, database)
        provider = start_provider_process(dimension=384)
        fleet = cls(url, provider, "")
        created = await asyncio.to_thread(
            fleet.kb, "tenants", "create", TENANT, "--tier", "standard"
        )
        key = re.search(r"KB_API_KEY=(\S+)", created)
        assert key is not None
        fleet.key = key.group(1)
        return fleet

    def kb(self, *args: str) -> str:
        command = [kb_path(), *args]
        done = subprocess.run(command, env=self.env(), check=True, capture_output=True, text=True)
        return done.stdout

    def provider_requests(self) -> int:
        """Requests the provider answered since its quota was last set, whatever the status."""
        return sum(self.provider.control.stats()["answered"].values())

    def env(self, **settings: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
        env.update(
            DATABASE_URL=self.url,
            KB_LOG_LEVEL="warning",
            KB_EMBEDDING_PROVIDER="openai",
            KB_EMBEDDING_BASE_URL=self.provider.base_url,
            KB_EMBEDDING_MODEL=MODEL,
            KB_EMBEDDING_DIMENSIONS="384",
        )
        env.update(settings)
        return env

    async def start(self, *args: str, **settings: str) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(kb_path(), *args, env=self.env(**settings))
        self.processes.append(process)
        return process

    async def start_indexer(self, **settings: str) -> asyncio.subprocess.Process:
        return await self.start("indexer", "run", "--tier", "standard", "--no-hints", **settings)

    async def start_api(self, **settings: str) -> str:
        port = free_port()
        await self.start("serve", "--port", str(port), **settings)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base) as client:
            for _ in range(600):
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        return base
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise SystemExit("kb serve did not get ready")

    async def publish(self, base: str, documents: list[bytes], batch: int = 500) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        path = f"/v1/tenants/{TENANT}/documents/bulk"
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as client:
            for start in range(0, len(documents), batch):
                part = documents[start : start + batch]
                items = [
                    {"title": f"Doc {start + n}", "acl": {"read": ["group:all"]}}
                    for n in range(len(part))
                ]
                files: list[tuple[str, Any]] = [
                    ("items", (None, json.dumps(items), "application/json"))
                ]
                files += [
                    ("file", (f"d{n}.txt", text, "text/plain")) for n, text in enumerate(part)
                ]
                response = await client.post(path, files=files)
                response.raise_for_status()
                if response.json()["refused"]:
                    raise SystemExit(f"items refused: {response.text[:500]}")

    async def stop(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 60)
            except TimeoutError:
                process.kill()
                await process.wait()
        self.provider.stop()


async def task_counts(conn: asyncpg.Connection[Any]) -> dict[str, int]:
    rows = await conn.fetch("SELECT status, count(*) AS n FROM index_task GROUP BY status")
    return {row["status"]: row["n"] for row in rows}


async def attempts_spent(conn: asyncpg.Connection[Any]) -> int:
    return int(await conn.fetchval("SELECT coalesce(sum(attempts), 0) FROM index_task"))
