"""The foundation talks to the real servers: a pgvector query and a Kafka round trip."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.runtime.errors import Conflict
from services.runtime.pg.db import translate_db_errors
from services.runtime.settings import RuntimeSettings

pytestmark = pytest.mark.integration


async def test_pgvector_nearest_neighbour_query(pool: asyncpg.Pool[Any]) -> None:
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE probe (id int PRIMARY KEY, embedding vector(3))")
        await conn.executemany(
            "INSERT INTO probe VALUES ($1, $2)",
            [
                (1, [1.0, 0.0, 0.0]),
                (2, [0.0, 1.0, 0.0]),
                (3, [0.9, 0.1, 0.0]),
            ],
        )
        rows = await conn.fetch(
            "SELECT id, embedding <=> $1 AS distance FROM probe ORDER BY distance LIMIT 2",
            [1.0, 0.05, 0.0],
        )
        assert [r["id"] for r in rows] == [1, 3]
        embedding = await conn.fetchval("SELECT embedding FROM probe WHERE id = 2")
        assert embedding.to_list() == [0.0, 1.0, 0.0]


async def test_each_test_gets_its_own_migrated_database(
    conn: asyncpg.Connection[Any], database_url: str
) -> None:
    assert await conn.fetchval("SELECT count(*) FROM tenant") == 0
    name = await conn.fetchval("SELECT current_database()")
    assert name.startswith("kbtest_")
    assert database_url.endswith(name)
    await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ('acme', 'standard')")


async def test_unique_violations_become_domain_conflicts(conn: asyncpg.Connection[Any]) -> None:
    await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ('acme', 'standard')")
    with pytest.raises(Conflict) as raised, translate_db_errors():
        await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ('acme', 'gold')")
    assert raised.value.code == "UNIQUE_VIOLATION"
    assert "tenant_pkey" in raised.value.message


async def test_kafka_produce_consume_round_trip(settings: RuntimeSettings) -> None:
    topic = settings.topic("roundtrip")
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()

    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap_servers, acks="all", enable_idempotence=True
    )
    await producer.start()
    sent = [uuid.uuid4().hex for _ in range(20)]
    try:
        for value in sent:
            await producer.send(
                topic, value.encode(), key=b"acme/doc-1", headers=[("event_type", b"Probe")]
            )
        await producer.flush()
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.kafka_bootstrap_servers,
        group_id=f"{topic}.reader",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    received: list[str] = []
    try:
        async with asyncio.timeout(30):
            while len(received) < len(sent):
                message = await consumer.getone()
                assert message.key == b"acme/doc-1"
                assert dict(message.headers)["event_type"] == b"Probe"
                assert message.value is not None
                received.append(message.value.decode())
    finally:
        await consumer.stop()
    # One key, one partition: Kafka keeps the order we sent in.
    assert received == sent
