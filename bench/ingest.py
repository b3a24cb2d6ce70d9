"""Publish by event against publish over HTTP, same run (issue 44).

    uv run python -m bench.ingest --documents 2000 --rate 5 --seconds 60

Real processes on a database of their own: `kb serve`, `kb relay run`, `kb ingest run
--tier standard` and (second part) `kb indexer run --tier standard` with the hashing
embedding provider (no model: the figures are the pipeline's, not a model's).

1. Throughput, indexer not running: ``--documents`` ~1.25 KB documents of the bench's corpus
   published through the bulk endpoint (``POST .../documents/bulk``, batches of 500, 4
   requests at once), then the same documents as signed ``PublishDocument`` commands (inline
   content) sent as fast as the producer can to ``kb.ingest.standard`` and applied by
   `kb ingest run` (a tenant's run of up to ``--apply-batch`` commands per transaction; new
   documents written together, as the bulk endpoint writes them). Each side's requests
   (commands, built and signed) are made before its clock starts, and the relay has sent
   every event of what came before (its work does not run into a span); each rate runs from
   the first request (the first send) to the last answer (the last command recorded in
   ``ingest_command``). Reported: documents/s of each and ingest/bulk, and the CPU time per
   item of `kb serve` (bulk) and of `kb ingest run` (commands) over their spans.
2. Latency, indexer running: one-paragraph documents at ``--rate`` per second for
   ``--seconds`` over HTTP (upload, then publish: the API's two calls), then as many
   commands at the same rate. Per document, from the moment the client sent (its first
   request; the command's send) to the commit that made it searchable
   (``document_search_version.switched_at``), split at the publish commit
   (``document_version.published_at``). Client and database share the machine's clock.

Needs DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.bulk_publish import bulk_rate, upload_and_publish, wait_ready
from bench.indexing_throughput import corpus, free_port, process_tree_cpu_seconds
from bench.latency import Bench, pct
from kbtools.demo.processes import DemoProcesses
from services.publisher.ingest.signing import public_bytes
from services.runtime.messaging.events import (
    document_events_topic,
    index_hints_topic,
    ingest_topic,
)
from tests.support.ingest import Signer, publish_command

TIER = "standard"
TENANT = "bench"


async def count(url: str, query: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        found: int = await conn.fetchval(query)
        return found
    finally:
        await conn.close()


async def wait_count(
    url: str, query: str, target: int, limit_seconds: float = 600, poll_seconds: float = 0.05
) -> float:
    """Polls ``query`` until it reaches ``target``; the monotonic time it did (late by at
    most ``poll_seconds`` and a query)."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + limit_seconds
        while time.monotonic() < deadline:
            if await conn.fetchval(query) >= target:
                return time.monotonic()
            await asyncio.sleep(poll_seconds)
    finally:
        await conn.close()
    raise RuntimeError(f"{query!r} did not reach {target} in {limit_seconds} s")


APPLIED = "SELECT count(*) FROM ingest_command"
# A command ready for the producer: value, key, headers.
Signed = tuple[bytes, bytes, list[tuple[str, bytes]]]
SEARCHABLE = "SELECT count(*) FROM document_search_version"


class IngestBench:
    def __init__(self, bench: Bench, url: str, env: dict[str, str], api_key: str) -> None:
        self.bench = bench
        self.url = url
        self.env = env
        self.signer = Signer(TENANT)
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.topic = ingest_topic(TIER, env["KB_KAFKA_TOPIC_PREFIX"])
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bench.kafka, acks="all", linger_ms=5, max_batch_size=1 << 20
        )

    def command(self, key: str, content: bytes, title: str) -> Signed:
        """A signed command, ready to send: its value, key and headers."""
        value = publish_command(TENANT, key, content, title=title)
        return value, f"{TENANT}/{key}".encode(), self.signer.headers(value)

    async def send(self, key: str, content: bytes, title: str) -> None:
        value, key_bytes, headers = self.command(key, content, title)
        await self.producer.send_and_wait(self.topic, value, key=key_bytes, headers=headers)

    async def ingest_rate(
        self, documents: list[bytes], prefix: str, ingest_pid: int | None = None
    ) -> dict[str, float]:
        """Documents/s from the first send to the last command recorded, the seconds the
        sends took (the producer's share of that time), and ``kb ingest run``'s CPU time
        per command over that span. The commands are built and signed before the clock
        starts (the bulk side builds its requests before it too), then handed to the
        producer all at once and their acknowledgements awaited together, as a producer
        that batches sends them."""
        commands = [
            self.command(f"{prefix}/{n}", text, f"Doc {n}") for n, text in enumerate(documents)
        ]
        before = await count(self.url, APPLIED)
        cpu = process_tree_cpu_seconds(ingest_pid) if ingest_pid else 0.0
        began = time.monotonic()
        acks = [
            await self.producer.send(self.topic, value, key=key, headers=headers)
            for value, key, headers in commands
        ]
        await asyncio.gather(*acks)
        sent = time.monotonic()
        done = await wait_count(self.url, APPLIED, before + len(documents), poll_seconds=0.01)
        spent = process_tree_cpu_seconds(ingest_pid) - cpu if ingest_pid else 0.0
        return {
            "per_second": len(documents) / (done - began),
            "send_seconds": sent - began,
            "seconds": done - began,
            "cpu_ms_per_command": spent / len(documents) * 1000,
        }

    async def wait_relayed(self, limit_seconds: float = 300) -> None:
        """Until the relay has sent every outbox row (the end offsets of the event topics
        add up to the outbox's rows, at least): the relay's work for one side's documents
        must not run on into the other side's timed span."""
        prefix = self.env["KB_KAFKA_TOPIC_PREFIX"]
        topics = [index_hints_topic(TIER, prefix), document_events_topic(prefix)]
        # No group: subscribed, it is given every partition of the topics (never reads).
        consumer = AIOKafkaConsumer(*topics, bootstrap_servers=self.bench.kafka)
        await consumer.start()
        rows = 0
        ends: dict[Any, int] = {}
        try:
            deadline = time.monotonic() + limit_seconds
            while time.monotonic() < deadline:
                rows = await count(self.url, "SELECT count(*) FROM outbox")
                parts = list(consumer.assignment())
                ends = await consumer.end_offsets(parts) if parts else {}
                if parts and sum(ends.values()) >= rows:
                    return
                await asyncio.sleep(0.1)
        finally:
            await consumer.stop()
        raise RuntimeError(f"the relay did not catch up in {limit_seconds} s: {rows} rows, {ends}")

    async def latencies(
        self, client: httpx.AsyncClient, rate: float, seconds: float, mode: str
    ) -> dict[str, list[float]]:
        sent: dict[str, float] = {}

        async def one(n: int) -> None:
            title = f"{mode} {n}"
            text = (
                f"# {title}\n\nStore {n % 40} opens at {7 + n % 4}:00 on weekdays; returns are "
                f"accepted at desk {n % 9} until {17 + n % 3}:30, receipts required (ref {n})."
            ).encode()
            sent[title] = time.time()
            if mode == "event":
                await self.send(f"l/{n}", text, title)
                return
            path = f"/v1/tenants/{TENANT}/documents"
            await upload_and_publish(client, path, (f"n{n}.md", text, "text/markdown"), title)

        before = await count(self.url, SEARCHABLE)
        total = int(rate * seconds)
        started = time.monotonic()
        tasks = []
        for n in range(total):
            delay = started + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(n)))
        await asyncio.gather(*tasks)
        await wait_count(self.url, SEARCHABLE, before + total)
        conn = await asyncpg.connect(self.url)
        try:
            rows = await conn.fetch(
                """SELECT d.title, v.published_at, s.switched_at
                     FROM document_search_version s
                     JOIN document_version v USING (tenant_id, document_id, version_number)
                     JOIN document d USING (tenant_id, document_id)
                    WHERE d.title LIKE $1""",
                f"{mode} %",
            )
        finally:
            await conn.close()
        out: dict[str, list[float]] = {"to_commit": [], "commit_to_searchable": [], "total": []}
        for row in rows:
            began = sent[row["title"]]
            published, switched = row["published_at"].timestamp(), row["switched_at"].timestamp()
            out["to_commit"].append(published - began)
            out["commit_to_searchable"].append(switched - published)
            out["total"].append(switched - began)
        return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url, kafka = os.environ.get("DATABASE_URL"), os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not admin_url or not kafka:
        raise SystemExit("DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS are needed")
    home = Path(tempfile.mkdtemp(prefix="kb-bench-ingest-"))
    bench = Bench(admin_url, kafka, home)
    url = await bench.fresh_database(args.database)
    env = bench.env(
        url,
        f"bench{uuid.uuid4().hex[:6]}.",
        KB_EMBEDDING_PROVIDER="hashing",
        KB_LOG_LEVEL="warning",
        KB_INGEST_POLL_TIMEOUT_SECONDS="0.2",
        KB_INGEST_TENANT_IN_FLIGHT=str(args.tenant_in_flight),
        KB_INGEST_APPLY_BATCH=str(args.apply_batch),
    )
    bench.kb(env, "migrate")
    api_key = bench.kb(env, "tenants", "create", TENANT, "--tier", TIER).strip().split("=", 1)[1]
    ingest = IngestBench(bench, url, env, api_key)
    public = base64.b64encode(public_bytes(ingest.signer.private_key)).decode()
    bench.kb(env, "tenants", "ingest-keys", "add", TENANT, "k1", "--public-key", public)
    processes = DemoProcesses(home)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {
        "documents": args.documents,
        "embedding_provider": "hashing",
        "tenant_in_flight": args.tenant_in_flight,
        "apply_batch": args.apply_batch,
    }
    try:
        api = processes.start("api", ["services.cli", "serve", "--port", str(port)], env).pid
        processes.start("relay", ["services.cli", "relay", "run"], env)
        consumer = processes.start(
            "ingest", ["services.cli", "ingest", "run", "--tier", TIER], env
        ).pid
        await ingest.producer.start()
        await wait_ready(base)
        async with httpx.AsyncClient(base_url=base, headers=ingest.headers, timeout=300) as client:
            # Warm up both paths: topics created, the consumer group joined, pools opened.
            await ingest.ingest_rate(corpus("documents", 2, seed=3), "warm")
            await bulk_rate(client, f"/v1/tenants/{TENANT}/documents/bulk", corpus("d", 2), 2)
            documents = corpus("documents", args.documents, seed=11)
            await ingest.wait_relayed()
            cpu = process_tree_cpu_seconds(api)
            bulk = await bulk_rate(
                client, f"/v1/tenants/{TENANT}/documents/bulk", documents, args.batch
            )
            api_cpu = process_tree_cpu_seconds(api) - cpu
            await ingest.wait_relayed()  # the bulk's events sent before the commands start
            event = await ingest.ingest_rate(documents, "t", consumer)
            result["throughput"] = {
                "bulk_docs_per_second": bulk,
                "ingest_docs_per_second": event["per_second"],
                "ingest_over_bulk": event["per_second"] / bulk,
                "ingest_send_seconds": event["send_seconds"],
                "ingest_seconds": event["seconds"],
                # CPU time (ticks of 10 ms, from /proc) of `kb serve` per document over the
                # bulk requests, and of `kb ingest run` per command from the first send to
                # the last command recorded: what holds still on a loaded machine.
                "api_cpu_ms_per_document": api_cpu / len(documents) * 1000,
                "ingest_cpu_ms_per_command": event["cpu_ms_per_command"],
            }
            if args.no_latency:
                return result
            processes.start("indexer", ["services.cli", "indexer", "run", "--tier", TIER], env)
            published = await count(url, "SELECT count(*) FROM document_version")
            await wait_count(url, SEARCHABLE, published, limit_seconds=3600)
            result["latency"] = {}
            for mode in ("http", "event"):
                found = await ingest.latencies(client, args.rate, args.seconds, mode)
                result["latency"][mode] = {
                    part: {
                        "n": len(values),
                        "p50_ms": pct(values, 0.5) * 1000,
                        "p99_ms": pct(values, 0.99) * 1000,
                    }
                    for part, values in found.items()
                }
    finally:
        await ingest.producer.stop()
        processes.stop_all()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rate", type=float, default=5)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--database", default="kb_bench_ingest")
    # KB_INGEST_TENANT_IN_FLIGHT of `kb ingest run` (the bench's one tenant is capped by it).
    parser.add_argument("--tenant-in-flight", type=int, default=4)
    # KB_INGEST_APPLY_BATCH: most commands of a tenant in one transaction.
    parser.add_argument("--apply-batch", type=int, default=500)
    parser.add_argument("--no-latency", action="store_true", help="throughput only")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
