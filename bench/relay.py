"""Relay vs a raw aiokafka producer, same run, same Kafka, same payloads.

    uv run python -m bench.relay --events 20000 --rate 1000 --seconds 10

1. Throughput. Raw: one idempotent producer (acks=all) sends N payloads and waits for every
   acknowledgement. Relay: N outbox rows are committed in one transaction while a relay is
   running idle (leases held, producer connected); we time from that commit to Kafka's
   acknowledgement of the last row (counted in the relay's after-ack seam). events/s each.
2. Latency at --rate events/s for --seconds. Raw: time from just before `send` to a consumer
   receiving the record. Relay: writers commit one event per transaction at the target rate
   (spread over --writers connections); time from the COMMIT returning to a consumer
   receiving the record. p50/p99/max each.

Needs DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS (or the dev stack, `kb dev up`). Creates and
drops a database of its own; topics get a fresh prefix. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.databases import drop_database, recreate_database
from services.relay.outbox_pg import PgLeaseStore, PgOutboxSource, PgWakeups, create_relay_pool
from services.relay.ports import Lease, OutboxRecord
from services.relay.relay import Relay
from services.relay.settings import RelaySettings
from services.relay.sink_kafka import KafkaSink
from services.runtime.logging import configure_logging
from services.runtime.messaging.events import document_events_topic
from services.runtime.messaging.outbox import OutboxEvent, add_event, aggregate_key
from services.runtime.settings import RuntimeSettings

BENCH_DB = "kb_bench_relay"
PAYLOAD_BYTES = 200
DOCUMENTS = 500


@dataclass
class Latency:
    samples_ms: list[float] = field(default_factory=list)

    def pct(self, q: float) -> float:
        ordered = sorted(self.samples_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _payload(i: int) -> bytes:
    return (f"{i:08d}".encode() * (PAYLOAD_BYTES // 8 + 1))[:PAYLOAD_BYTES]


async def _create_database(admin_url: str) -> str:
    return await recreate_database(admin_url, BENCH_DB, migrate=True)


async def _drop_database(admin_url: str) -> None:
    await drop_database(admin_url, BENCH_DB)


async def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


def _producer(bootstrap: str) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0
    )


class Receiver:
    """Consumes a topic from its end and notes when each record (by its id) arrived."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=None,
            auto_offset_reset="latest",
            fetch_max_wait_ms=5,
        )
        self.arrived: dict[str, float] = {}
        self._grew = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.consumer.start()
        # Wait until partitions are assigned and positioned, so nothing sent later is missed.
        async with asyncio.timeout(30):
            while not self.consumer.assignment():  # noqa: ASYNC110 (aiokafka has no signal)
                await asyncio.sleep(0.05)
        for tp in self.consumer.assignment():
            await self.consumer.position(tp)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=50)
            now = time.perf_counter()
            for records in batches.values():
                for message in records:
                    ident = dict(message.headers).get("event_id")
                    if ident is not None:
                        self.arrived.setdefault(ident.decode(), now)
            self._grew.set()

    async def wait_for(self, count: int, timeout_s: float = 120) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.arrived) < count:
                self._grew.clear()
                await self._grew.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()


# --- raw producer ---------------------------------------------------------------------------


async def raw_throughput(bootstrap: str, topic: str, events: int) -> float:
    producer = _producer(bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"warm-up", key=b"warm/up")
        started = time.perf_counter()
        futures = [
            await producer.send(
                topic,
                _payload(i),
                key=f"acme/doc-{i % DOCUMENTS}".encode(),
                headers=[("event_id", uuid.uuid4().hex.encode())],
            )
            for i in range(events)
        ]
        await asyncio.gather(*futures)
        return events / (time.perf_counter() - started)
    finally:
        await producer.stop()


async def raw_latency(bootstrap: str, topic: str, rate: int, seconds: float) -> Latency:
    receiver = Receiver(bootstrap, topic)
    await receiver.start()
    producer = _producer(bootstrap)
    await producer.start()
    sent_at: dict[str, float] = {}
    try:
        total = int(rate * seconds)
        started = time.perf_counter()
        pending: list[asyncio.Future[Any]] = []
        for i in range(total):
            due = started + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            ident = uuid.uuid4().hex
            sent_at[ident] = time.perf_counter()
            pending.append(
                await producer.send(
                    topic,
                    _payload(i),
                    key=f"acme/doc-{i % DOCUMENTS}".encode(),
                    headers=[("event_id", ident.encode())],
                )
            )
        await asyncio.gather(*pending)
        await receiver.wait_for(total)
    finally:
        await producer.stop()
        await receiver.stop()
    return Latency([(receiver.arrived[k] - v) * 1000 for k, v in sent_at.items()])


# --- relay ---------------------------------------------------------------------------------


class Acked:
    def __init__(self) -> None:
        self.count = 0
        self.last_at = 0.0
        self.reached = asyncio.Event()
        self.target = 0

    async def __call__(self, lease: Lease, records: Sequence[OutboxRecord]) -> None:
        self.count += len(records)
        self.last_at = time.perf_counter()
        if self.target and self.count >= self.target:
            self.reached.set()


def _relay(settings: RelaySettings, pool: asyncpg.Pool[Any], acked: Acked) -> Relay:
    return Relay(
        settings,
        leases=PgLeaseStore(pool),
        source=PgOutboxSource(pool),
        sink=KafkaSink(settings),
        wakeups=PgWakeups(settings),
        after_ack=acked,
    )


def _event(i: int, event_id: uuid.UUID | None = None) -> OutboxEvent:
    return OutboxEvent(
        event_type="DocumentPublished",
        tenant_id="acme",
        tier="standard",
        aggregate_key=aggregate_key("acme", f"doc-{i % DOCUMENTS}"),
        payload=_payload(i),
        event_id=event_id or uuid.uuid4(),
    )


async def relay_throughput(settings: RelaySettings, events: int) -> float:
    pool = await create_relay_pool(settings)
    acked = Acked()
    relay = _relay(settings, pool, acked)
    try:
        async with relay:
            await relay.wait_for_partitions(settings.relay_partitions)
            await asyncio.sleep(0.5)  # producer connected, first idle windows read
            acked.target = events
            async with pool.acquire() as conn, conn.transaction():
                await conn.executemany(
                    "INSERT INTO outbox (event_id, event_type, tenant_id, tier, aggregate_key,"
                    " payload) VALUES ($1, $2, $3, $4, $5, $6)",
                    [
                        (e.event_id, e.event_type, e.tenant_id, e.tier, e.aggregate_key, e.payload)
                        for e in (_event(i) for i in range(events))
                    ],
                )
            committed = time.perf_counter()
            async with asyncio.timeout(300):
                await acked.reached.wait()
            return events / (acked.last_at - committed)
    finally:
        await pool.close()


async def relay_latency(
    settings: RelaySettings, topic: str, rate: int, seconds: float, writers: int
) -> Latency:
    pool = await create_relay_pool(settings)
    writer_pool = await asyncpg.create_pool(settings.database_url, min_size=writers)
    receiver = Receiver(settings.kafka_bootstrap_servers, topic)
    await receiver.start()
    acked = Acked()
    committed_at: dict[str, float] = {}
    total = int(rate * seconds)
    try:
        async with _relay(settings, pool, acked) as relay:
            await relay.wait_for_partitions(settings.relay_partitions)
            await asyncio.sleep(0.5)
            started = time.perf_counter()

            async def writer(index: int) -> None:
                async with writer_pool.acquire() as conn:
                    for i in range(index, total, writers):
                        delay = started + i / rate - time.perf_counter()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        event = _event(i)
                        async with conn.transaction():
                            await add_event(conn, event)
                        committed_at[str(event.event_id)] = time.perf_counter()

            await asyncio.gather(*(writer(w) for w in range(writers)))
            achieved = total / (time.perf_counter() - started)
            print(f"  relay writers achieved {achieved:.0f} commits/s")
            await receiver.wait_for(total)
    finally:
        await receiver.stop()
        await writer_pool.close()
        await pool.close()
    return Latency([(receiver.arrived[k] - v) * 1000 for k, v in committed_at.items()])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()
    configure_logging("warning", "console")

    base = RuntimeSettings()
    admin_url = os.environ.get("DATABASE_URL", base.database_url)
    bootstrap = base.kafka_bootstrap_servers
    database_url = await _create_database(admin_url)
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    settings = RelaySettings(
        database_url=database_url,
        kafka_bootstrap_servers=bootstrap,
        kafka_topic_prefix=prefix,
        relay_partitions=args.partitions,
        relay_batch_size=args.batch_size,
        relay_metrics_interval_seconds=60,
    )
    relay_topic = document_events_topic(prefix)
    raw_topic = settings.topic("bench.raw")
    await _create_topic(bootstrap, raw_topic, settings.relay_topic_partitions)
    await _create_topic(bootstrap, relay_topic, settings.relay_topic_partitions)
    try:
        print(f"throughput: {args.events} events of {PAYLOAD_BYTES} bytes")
        raw_eps = await raw_throughput(bootstrap, raw_topic, args.events)
        print(f"  raw producer   {raw_eps:10.0f} events/s")
        relay_eps = await relay_throughput(settings, args.events)
        print(f"  relay          {relay_eps:10.0f} events/s   ({relay_eps / raw_eps:.2f}x raw)")

        print(f"latency at {args.rate} events/s for {args.seconds:.0f}s")
        raw = await raw_latency(bootstrap, raw_topic, args.rate, args.seconds)
        print(
            f"  raw producer   p50 {raw.pct(0.5):6.1f} ms  p99 {raw.pct(0.99):6.1f} ms"
            f"  max {max(raw.samples_ms):6.1f} ms  (n={len(raw.samples_ms)})"
        )
        relay = await relay_latency(settings, relay_topic, args.rate, args.seconds, args.writers)
        print(
            f"  relay          p50 {relay.pct(0.5):6.1f} ms  p99 {relay.pct(0.99):6.1f} ms"
            f"  max {max(relay.samples_ms):6.1f} ms  (n={len(relay.samples_ms)},"
            f" mean {statistics.fmean(relay.samples_ms):.1f} ms)"
        )
    finally:
        await _drop_database(admin_url)


if __name__ == "__main__":
    asyncio.run(main())
