"""`kb ingest run` started while the broker is unreachable waits for it (found by the
chaos run: a consumer restarted during a Kafka outage exited)."""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaConnectionError

from services.publisher.ingest.consumer_kafka import start_when_reachable
from services.runtime.backoff import Backoff

FAST = Backoff(0.001, 0.002)


async def test_a_start_is_tried_again_until_the_broker_answers() -> None:
    attempts = 0

    async def start() -> None:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise KafkaConnectionError("Unable to bootstrap")

    assert await start_when_reachable(start, asyncio.Event(), FAST, client="consumer")
    assert attempts == 3


async def test_a_stop_ends_the_wait() -> None:
    stop = asyncio.Event()

    async def start() -> None:
        stop.set()  # SIGTERM while the broker is still away
        raise KafkaConnectionError("Unable to bootstrap")

    assert not await start_when_reachable(start, stop, FAST, client="consumer")
