"""Publish -> searchable latency through real processes, with Kafka hints and poll-only.

    uv run python -m bench.latency --rate 5 --seconds 60

For each mode (hints, then poll-only with the default poll interval) it starts `kb serve`,
`kb relay run` and `kb indexer run --tier standard` (the offline ONNX model) on a database of
its own, publishes one-paragraph Markdown documents at --rate per second for --seconds, and
measures, per document, from the publish commit (document_version.published_at) to the
commit that made it searchable (document_search_version.switched_at) -- both on the
database's clock. The p50 is broken down by stage: publish commit -> relay send (the hint's
Kafka timestamp) -> claim (the indexer's task.claimed log line) -> sink commit.
Then the idle cost: transactions per second of an idle indexer pool of 4 processes, hints on
vs poll-only (pg_stat_database.xact_commit of the bench database).

With ``--backfill N`` (issue 28) each mode first publishes N documents through the bulk API
and, once they are searchable, starts a model migration's backfill: `kb index generations
create` of a second generation (the same model, 128-token chunks) for the tenant. The
documents published at --rate then run beside that backfill (and are indexed into both
generations: the dual write); the report adds the backfill's documents/s during the
publishing window.

Needs DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS (or `kb dev up`). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from aiokafka import AIOKafkaConsumer

from kbtools.demo.processes import DemoProcesses
from kbtools.demo.stack import free_port
from services.embedding.onnx_local import MODEL_NAME
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import index_hints_topic

TIER = "standard"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Run:
    mode: str
    latencies: list[float]
    stages: dict[str, list[float]]
    published: int
    # --backfill: documents built into the new generation per second while publishing, and
    # how many of the backfill were left when publishing ended.
    backfill_rate: float | None = None
    backfill_left: int | None = None


class Bench:
    def __init__(self, admin_url: str, kafka: str, home: Path) -> None:
        self.admin_url = admin_url
        self.kafka = kafka
        self.home = home

    async def fresh_database(self, name: str) -> str:
        admin = await asyncpg.connect(self.admin_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        base, _, _ = self.admin_url.rpartition("/")
        return f"{base}/{name}"

    def env(self, database_url: str, prefix: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
        env.update(
            DATABASE_URL=database_url,
            KAFKA_BOOTSTRAP_SERVERS=self.kafka,
            KB_KAFKA_TOPIC_PREFIX=prefix,
            KB_LOG_FORMAT="json",
            **extra,
        )
        return env

    @staticmethod
    def kb(env: dict[str, str], *args: str) -> str:
        import subprocess

        done = subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return done.stdout

    async def run_mode(self, mode: str, rate: float, seconds: float, backfill: int = 0) -> Run:
        database_url = await self.fresh_database(f"kb_bench_latency_{mode}")
        prefix = f"bench{uuid.uuid4().hex[:6]}."
        env = self.env(database_url, prefix)
        self.kb(env, "migrate")
        key = self.kb(env, "tenants", "create", "bench", "--tier", TIER).strip().split("=", 1)[1]
        processes = DemoProcesses(self.home / mode)
        port = free_port()
        indexer_args = ["services.cli", "indexer", "run", "--tier", TIER]
        if mode == "poll":
            indexer_args.append("--no-hints")
        try:
            processes.start("api", ["services.cli", "serve", "--port", str(port)], env)
            processes.start("relay", ["services.cli", "relay", "run"], env)
            processes.start("indexer", indexer_args, env)
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(timeout=30) as client:
                await self.wait_ready(client, base)
                await self.warm_up(client, base, key, database_url)
                generation = None
                if backfill:
                    await self.bulk_publish(client, base, key, backfill)
                    await self.wait_searchable(database_url, backfill + 1, limit_seconds=1800)
                    generation = int(
                        self.kb(
                            env, "index", "generations", "create", "--provider", "default",
                            "--model", MODEL_NAME, "--dimensions", "384",
                            "--chunk-tokens", "128", "--tenant", "bench",
                        ).split()[-1]
                    )  # fmt: skip
                built_before = await self.built(database_url, generation)
                began = time.monotonic()
                published = await self.publish_at(client, base, key, rate, seconds)
                window = time.monotonic() - began
                built_after = await self.built(database_url, generation)
                await self.wait_searchable(
                    database_url, published + backfill + 1, limit_seconds=300
                )
            run = await self.measure(mode, database_url, prefix, published)
            if generation is not None:
                run.backfill_rate = (built_after - built_before) / window
                run.backfill_left = backfill + 1 - built_after
            return run
        finally:
            processes.stop_all()

    async def bulk_publish(
        self, client: httpx.AsyncClient, base: str, key: str, count: int
    ) -> None:
        """``count`` one-paragraph documents in requests of 500 (the backfill's corpus)."""
        headers = {"Authorization": f"Bearer {key}"}
        for start in range(0, count, 500):
            numbers = range(start, min(count, start + 500))
            items = [{"title": f"Old {n}", "acl": {"read": ["group:all"]}} for n in numbers]
            files: list[tuple[str, Any]] = [
                ("items", (None, json.dumps(items), "application/json"))
            ]
            files += [
                (
                    "file",
                    (
                        f"o{n}.txt",
                        f"Archive note {n}: shelf {n % 97}, box {n % 13}, kept until "
                        f"{2030 + n % 9}.".encode(),
                        "text/plain",
                    ),
                )
                for n in numbers
            ]
            response = await client.post(
                f"{base}/v1/tenants/bench/documents/bulk", files=files, headers=headers
            )
            response.raise_for_status()

    @staticmethod
    async def built(database_url: str, generation: int | None) -> int:
        """Backfill tasks (priority 1) of the generation done so far (0 without one)."""
        if generation is None:
            return 0
        conn = await asyncpg.connect(database_url)
        try:
            count: int = await conn.fetchval(
                "SELECT count(*) FROM index_task"
                " WHERE generation_id = $1 AND priority = 1 AND status = 'SUCCEEDED'",
                generation,
            )
            return count
        finally:
            await conn.close()

    async def wait_ready(self, client: httpx.AsyncClient, base: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{base}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("kb serve did not become ready")

    async def publish_one(self, client: httpx.AsyncClient, base: str, key: str, n: int) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        text = (
            f"# Notice {n}\n\nStore {n % 40} opens at {7 + n % 4}:00 on weekdays; returns are "
            f"accepted at desk {n % 9} until {17 + n % 3}:30, receipts required (ref {n})."
        )
        created = await client.post(
            f"{base}/v1/tenants/bench/documents",
            files={"file": (f"n{n}.md", text.encode(), "text/markdown")},
            data={"title": f"Notice {n}"},
            headers=headers,
        )
        created.raise_for_status()
        body = created.json()
        published = await client.post(
            f"{base}/v1/tenants/bench/documents/{body['documentId']}/versions/1/publish",
            json={"revision": body["revision"], "acl": {"read": ["group:all"]}},
            headers=headers,
        )
        published.raise_for_status()

    async def warm_up(
        self, client: httpx.AsyncClient, base: str, key: str, database_url: str
    ) -> None:
        """One document first: model loaded, topics created, consumer group joined."""
        await self.publish_one(client, base, key, 0)
        await self.wait_searchable(database_url, 1, limit_seconds=120)
        await asyncio.sleep(2)

    async def publish_at(
        self, client: httpx.AsyncClient, base: str, key: str, rate: float, seconds: float
    ) -> int:
        count = int(rate * seconds)
        started = time.monotonic()
        tasks = []
        for n in range(1, count + 1):
            delay = started + (n - 1) / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.publish_one(client, base, key, n)))
        await asyncio.gather(*tasks)
        return count

    async def wait_searchable(self, database_url: str, count: int, limit_seconds: float) -> None:
        conn = await asyncpg.connect(database_url)
        try:
            deadline = time.monotonic() + limit_seconds
            while time.monotonic() < deadline:
                if await conn.fetchval("SELECT count(*) FROM document_search_version") >= count:
                    return
                await asyncio.sleep(0.25)
        finally:
            await conn.close()
        raise RuntimeError(f"fewer than {count} documents became searchable in {limit_seconds} s")

    async def measure(self, mode: str, database_url: str, prefix: str, published: int) -> Run:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                """SELECT t.task_id, v.published_at, s.switched_at
                     FROM document_search_version s
                     JOIN document_version v USING (tenant_id, document_id, version_number)
                     JOIN index_task t USING (tenant_id, document_id, version_number)
                     JOIN document d USING (tenant_id, document_id)
                    WHERE d.title LIKE 'Notice %' AND d.title <> 'Notice 0'
                      AND t.generation_id IS NULL"""
            )
        finally:
            await conn.close()
        sent = await self.hint_timestamps(prefix)
        claimed = self.claim_times(self.home / mode / "indexer.log")
        latencies: list[float] = []
        stages: dict[str, list[float]] = {"relay": [], "claim": [], "index+sink": []}
        for row in rows:
            published_at: datetime = row["published_at"]
            switched_at: datetime = row["switched_at"]
            latencies.append((switched_at - published_at).total_seconds())
            task = str(row["task_id"])
            if task in sent and task in claimed:
                stages["relay"].append(sent[task] - published_at.timestamp())
                stages["claim"].append(claimed[task] - sent[task])
                stages["index+sink"].append(switched_at.timestamp() - claimed[task])
        return Run(mode, latencies, stages, published)

    async def hint_timestamps(self, prefix: str) -> dict[str, float]:
        consumer = AIOKafkaConsumer(
            index_hints_topic(TIER, prefix),
            bootstrap_servers=self.kafka,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await consumer.start()
        registry = default_registry()
        found: dict[str, float] = {}
        try:
            quiet = 0
            while quiet < 3:
                batches = await consumer.getmany(timeout_ms=500)
                quiet = 0 if batches else quiet + 1
                for records in batches.values():
                    for record in records:
                        decoded = registry.decode(record.value)
                        found[str(decoded.record["taskId"])] = record.timestamp / 1000
        finally:
            await consumer.stop()
        return found

    @staticmethod
    def claim_times(log: Path) -> dict[str, float]:
        claimed: dict[str, float] = {}
        for line in log.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == "task.claimed" and "task_id" in entry:
                when = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
                claimed.setdefault(entry["task_id"], when.timestamp())
        return claimed

    async def idle_cost(self, hints: bool, processes_count: int, seconds: float) -> float:
        mode = "idle-hints" if hints else "idle-poll"
        database_url = await self.fresh_database(f"kb_bench_latency_{mode.replace('-', '_')}")
        prefix = f"bench{uuid.uuid4().hex[:6]}."
        env = self.env(database_url, prefix)
        self.kb(env, "migrate")
        processes = DemoProcesses(self.home / mode)
        args = ["services.cli", "indexer", "run", "--tier", TIER]
        if not hints:
            args.append("--no-hints")
        try:
            for n in range(processes_count):
                processes.start(f"indexer-{n}", args, env)
            await asyncio.sleep(10)  # started, connected, settled
            conn = await asyncpg.connect(database_url)
            try:
                query = (
                    "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
                )
                before = await conn.fetchval(query)
                await asyncio.sleep(seconds)
                after = await conn.fetchval(query)
            finally:
                await conn.close()
            # The probe's own two statements are negligible beside the pool's.
            return float(after - before) / seconds
        finally:
            processes.stop_all()


def report(runs: list[Run], idle: dict[str, float], args: argparse.Namespace) -> str:
    lines = [
        f"command: uv run python -m bench.latency --rate {args.rate} --seconds {args.seconds}"
        + (f" --backfill {args.backfill}" if args.backfill else ""),
        "",
        "| mode | documents | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        values = run.latencies
        lines.append(
            f"| {run.mode} | {len(values)} | {pct(values, 0.5) * 1000:.0f} ms | "
            f"{pct(values, 0.9) * 1000:.0f} ms | {pct(values, 0.99) * 1000:.0f} ms | "
            f"{max(values) * 1000:.0f} ms |"
        )
    lines += [
        "",
        "p50 by stage (ms):",
        "",
        "| mode | publish->relay send | send->claim | claim->searchable |",
        "|---|---:|---:|---:|",
    ]
    for run in runs:
        stage = {
            k: statistics.median(v) * 1000 if v else float("nan") for k, v in run.stages.items()
        }
        lines.append(
            f"| {run.mode} | {stage['relay']:.0f} | {stage['claim']:.0f} | "
            f"{stage['index+sink']:.0f} |"
        )
    for run in runs:
        if run.backfill_rate is not None:
            lines.append(
                f"\n{run.mode}: the backfill built {run.backfill_rate:.1f} documents/s while "
                f"publishing; {run.backfill_left} were left when publishing ended"
            )
    if idle:
        lines += ["", "idle indexer pool of 4 processes, database transactions per second:", ""]
        lines += [f"- {mode}: {value:.1f}/s" for mode, value in idle.items()]
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--modes", nargs="+", default=["hints", "poll"])
    parser.add_argument("--backfill", type=int, default=0, help="documents to backfill")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle cost")
    args = parser.parse_args()
    admin = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:25432/kb")
    kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:29092")
    home = Path(tempfile.mkdtemp(prefix="kb-bench-latency-"))
    bench = Bench(admin, kafka, home)
    runs = [
        await bench.run_mode(mode, args.rate, args.seconds, args.backfill) for mode in args.modes
    ]
    idle = (
        {}
        if args.no_idle
        else {
            "hints on": await bench.idle_cost(True, 4, args.idle_seconds),
            "poll-only": await bench.idle_cost(False, 4, args.idle_seconds),
        }
    )
    text = report(runs, idle, args)
    print(text)
    print(f"\nlogs: {home}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
