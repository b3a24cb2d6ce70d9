"""The index's size over republishes and a generation's life (issue 28).

    uv run python -m bench.generation_space --republishes 100 --documents 50

On a scratch database: `kb serve` and `kb indexer run` (the hashing provider: sizes depend on
the rows, not on the model; 384 dimensions as the shipped model's) as processes. One tenant
publishes --documents documents of 24 paragraphs, then republishes one of them
--republishes times, each version edited, waiting until each is searchable. Every tenth
republish it lets the collector finish (no marked document left), VACUUMs the tenant's
partition as autovacuum would, and samples its live chunk rows, table bytes, index bytes and
free bytes (pgstattuple). Then a second generation (256 dimensions, another profile) is
created for the tenant, backfilled, and retired; the same sample is taken after its
backfill and after its retirement.

Needs DATABASE_URL (or `kb dev up`): the admin URL of a server whose user may create
databases and the pgstattuple extension. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from kbtools.demo.processes import DemoProcesses
from kbtools.demo.stack import free_port

BENCH_DB = "kb_bench_generation_space"
TENANT = "space"


@dataclass(frozen=True)
class Sample:
    label: str
    rows: int
    table_bytes: int
    index_bytes: int
    free_bytes: int


def document(n: int, edit: int) -> bytes:
    paragraphs = [
        f"Section {p} of policy {n}: requests of kind {p} go to desk {(n + p) % 11}, "
        f"answered within {2 + p} days; escalations to the lead of team {(n * p) % 7}."
        for p in range(24)
    ]
    # An edit rewrites one paragraph: the others' embeddings are reused.
    paragraphs[edit % 24] += f" Revised in edition {edit}."
    return ("\n\n".join(paragraphs) + "\n").encode()


def kb(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"kb {' '.join(args)} failed: {done.stderr}")
    return done.stdout


async def fresh_database(admin_url: str) -> str:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{BENCH_DB}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{BENCH_DB}"')
    finally:
        await admin.close()
    return f"{admin_url.rpartition('/')[0]}/{BENCH_DB}"


class Space:
    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self.conn = conn

    async def settle(self) -> None:
        """Until the collector has cleaned every marked document and no task is left."""
        while True:
            left = await self.conn.fetchval(
                "SELECT (SELECT count(*) FROM index_gc_due)"
                " + (SELECT count(*) FROM index_task WHERE status <> 'SUCCEEDED')"
            )
            if not left:
                return
            await asyncio.sleep(0.2)  # other processes' work: polling is the only signal

    async def sample(self, label: str) -> Sample:
        await self.settle()
        partition = await self.conn.fetchval(
            "SELECT tableoid::regclass::text FROM knowledge_chunk WHERE tenant_id = $1 LIMIT 1",
            TENANT,
        )
        await self.conn.execute(f"VACUUM {partition}")
        row = await self.conn.fetchrow(
            f"""SELECT (SELECT count(*) FROM knowledge_chunk WHERE tenant_id = $1) AS rows,
                       pg_table_size('{partition}') AS table_bytes,
                       pg_indexes_size('{partition}') AS index_bytes,
                       (pgstattuple('{partition}')).free_space AS free_bytes""",
            TENANT,
        )
        assert row is not None
        return Sample(label, row["rows"], row["table_bytes"], row["index_bytes"], row["free_bytes"])


async def wait_searchable(
    client: httpx.AsyncClient, document_id: str, version: int, indexer: Any
) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body = (await client.get(f"/v1/tenants/{TENANT}/documents/{document_id}")).json()
        if body["searchVersion"] == version:
            return
        if not indexer.alive():
            raise SystemExit("the indexer exited")
        await asyncio.sleep(0.05)
    raise SystemExit(f"{document_id} v{version} not searchable in 120 s")


async def publish(client: httpx.AsyncClient, n: int, document_id: str | None, edit: int) -> Any:
    files = {"file": (f"p{n}.txt", document(n, edit), "text/plain")}
    path = f"/v1/tenants/{TENANT}/documents"
    if document_id is None:
        made = await client.post(path, files=files, data={"title": f"Policy {n}"})
    else:
        made = await client.post(f"{path}/{document_id}/versions", files=files)
    made.raise_for_status()
    body = made.json()
    done = await client.post(
        f"{path}/{body['documentId']}/versions/{body['versionNumber']}/publish",
        json={"revision": body["revision"], "acl": {"read": ["group:all"]}},
    )
    done.raise_for_status()
    return body


async def run(args: argparse.Namespace, home: Path) -> list[Sample]:
    admin = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    database_url = await fresh_database(admin)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(
        DATABASE_URL=database_url,
        KB_LOG_FORMAT="json",
        KB_EMBEDDING_PROVIDER="hashing",
        KB_EMBEDDING_DIMENSIONS="384",
        KB_EMBEDDING_PROFILE_NEXT_PROVIDER="hashing",
        KB_INDEXER_POLL_SECONDS="0.05",
        KB_INDEX_GC_INTERVAL_SECONDS="0.2",
    )
    kb(env, "migrate")
    key = kb(env, "tenants", "create", TENANT, "--tier", "standard").strip().split("=", 1)[1]
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    space = Space(conn)
    processes = DemoProcesses(home)
    port = free_port()
    samples: list[Sample] = []
    try:
        processes.start("api", ["services.cli", "serve", "--port", str(port)], env)
        processes.start(
            "indexer", ["services.cli", "indexer", "run", "--tier", "standard", "--no-hints"], env
        )
        indexer = processes.running("indexer")
        headers = {"Authorization": f"Bearer {key}"}
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as client:
            for _ in range(600):
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            bodies = [await publish(client, n, None, 0) for n in range(args.documents)]
            for body in bodies:
                await wait_searchable(client, body["documentId"], 1, indexer)
            samples.append(await space.sample("published"))
            republished = bodies[0]["documentId"]
            for edit in range(1, args.republishes + 1):
                body = await publish(client, 0, republished, edit)
                await wait_searchable(client, republished, body["versionNumber"], indexer)
                if edit % max(1, args.republishes // 10) == 0:
                    samples.append(await space.sample(f"after {edit} republishes"))
            created = kb(
                env, "index", "generations", "create", "--provider", "next",
                "--model", "hashing-v1-256", "--dimensions", "256", "--tenant", TENANT,
            )  # fmt: skip
            generation = created.split()[-1]
            samples.append(await space.sample(f"generation {generation} built beside"))
            kb(env, "index", "generations", "retire", generation)
            samples.append(await space.sample(f"generation {generation} retired"))
    finally:
        processes.stop_all()
        await conn.close()
    return samples


def report(samples: list[Sample], args: argparse.Namespace) -> str:
    mib = 1024 * 1024
    lines = [
        "command: uv run python -m bench.generation_space "
        f"--republishes {args.republishes} --documents {args.documents}",
        "",
        "| after | chunk rows | table | indexes | free in table |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in samples:
        lines.append(
            f"| {s.label} | {s.rows} | {s.table_bytes / mib:.2f} MiB | "
            f"{s.index_bytes / mib:.2f} MiB | {s.free_bytes / mib:.2f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--republishes", type=int, default=100)
    parser.add_argument("--documents", type=int, default=50)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="kb-bench-space-"))
    samples = asyncio.run(run(args, home))
    print(report(samples, args))
    print(f"\nlogs: {home}", file=sys.stderr)


if __name__ == "__main__":
    main()
