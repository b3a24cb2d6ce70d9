"""The Kafka sink's producer state machine, on a fake producer: a failure retires only
the producer that failed, and a retired producer is never flushed."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime
from typing import Any, ClassVar

import pytest
from aiokafka.errors import KafkaConnectionError

from services.relay.ports import OutboxRecord
from services.relay.settings import RelaySettings
from services.relay.sink_kafka import KafkaSink
from services.runtime.errors import KafkaUnavailable


def _record(key: str) -> OutboxRecord:
    return OutboxRecord(
        position=1,
        event_id=uuid.uuid4(),
        event_type="DocumentPublished",
        tenant_id="acme",
        tier="standard",
        aggregate_key=key,
        payload=b"x",
        created_at=datetime.now(UTC),
    )


class _Accumulator:
    def __init__(self) -> None:
        self.failed = False

    def fail_all(self, exception: BaseException) -> None:
        self.failed = True


class FakeProducer:
    """Hands out a pending future per record; the test settles them. ``stop`` waits for
    ``stop_may_finish`` (a flush that takes its time)."""

    made: ClassVar[list[FakeProducer]] = []
    made_one: ClassVar[asyncio.Event | None] = None

    def __init__(self, **config: Any) -> None:
        self.config = config
        self.topics: list[str] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.sent = asyncio.Event()
        self.stopped = False
        self.stop_entered = asyncio.Event()
        self.failed_before_stop: bool | None = None
        self.stop_may_finish = asyncio.Event()
        self.stop_may_finish.set()
        self._message_accumulator = _Accumulator()
        FakeProducer.made.append(self)
        if FakeProducer.made_one is not None:
            FakeProducer.made_one.set()

    async def start(self) -> None:
        return None

    async def send(self, topic: str, **kwargs: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.topics.append(topic)
        self.futures.append(future)
        self.sent.set()
        return future

    async def stop(self) -> None:
        self.failed_before_stop = self._message_accumulator.failed
        self.stop_entered.set()
        await self.stop_may_finish.wait()
        self.stopped = True


@pytest.fixture
def sink() -> KafkaSink:
    FakeProducer.made = []
    settings = RelaySettings(relay_create_topics=False, relay_send_timeout_seconds=5.0)
    return KafkaSink(settings, producer_factory=FakeProducer)


async def _sending(producer: FakeProducer, sink: KafkaSink, key: str) -> asyncio.Task[None]:
    producer.sent.clear()
    task = asyncio.create_task(sink.send([_record(key)], replay=False))
    await producer.sent.wait()
    return task


async def test_a_late_failure_of_an_old_producer_leaves_the_new_one_alone(
    sink: KafkaSink,
) -> None:
    FakeProducer.made_one = made_one = asyncio.Event()
    await sink.start()
    [first] = FakeProducer.made
    made_one.clear()
    x = await _sending(first, sink, "acme/x")
    y = await _sending(first, sink, "acme/y")
    first.futures[0].set_exception(KafkaConnectionError("x failed"))
    with pytest.raises(KafkaUnavailable):
        await x
    # Another partition's send builds the next producer...
    send_z = asyncio.create_task(sink.send([_record("acme/z")], replay=False))
    async with asyncio.timeout(5):
        await made_one.wait()
        second = FakeProducer.made[1]
        await second.sent.wait()
    # ...and only then does y's failure on the first producer come in.
    first.futures[1].set_exception(KafkaConnectionError("y failed too"))
    with pytest.raises(KafkaUnavailable):
        await y
    second.futures[0].set_result(None)
    await send_z
    assert first.stopped
    assert not second.stopped
    # The next send still goes through the second producer.
    w = await _sending(second, sink, "acme/w")
    second.futures[1].set_result(None)
    await w
    assert len(FakeProducer.made) == 2


async def test_a_failed_producer_is_not_flushed(sink: KafkaSink) -> None:
    await sink.start()
    [producer] = FakeProducer.made
    producer.stop_may_finish.clear()  # its stop would take forever
    task = await _sending(producer, sink, "acme/x")
    producer.futures[0].set_exception(KafkaConnectionError("broker gone"))
    with pytest.raises(KafkaUnavailable):
        await task  # returns although the producer's stop has not finished
    await producer.stop_entered.wait()
    # What it still queued was failed before it was stopped: nothing left to flush.
    assert producer.failed_before_stop is True
    assert not producer.stopped
    producer.stop_may_finish.set()
    await sink.stop()


async def test_records_go_to_their_event_types_topic_over_the_configured_connection() -> None:
    FakeProducer.made = []
    settings = RelaySettings(
        relay_create_topics=False,
        kafka_topic_prefix="t1.",
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_mechanism="SCRAM-SHA-256",
        kafka_sasl_username="relay",
        kafka_sasl_password="pw",
    )
    sink = KafkaSink(settings, producer_factory=FakeProducer)
    await sink.start()
    [producer] = FakeProducer.made
    hint = dataclasses.replace(_record("acme/a"), event_type="IndexTaskCreated", tier="gold")
    sending = asyncio.create_task(sink.send([hint, _record("acme/b")], replay=False))
    async with asyncio.timeout(5):
        while len(producer.futures) < 2:
            producer.sent.clear()
            await producer.sent.wait()
    for future in producer.futures:
        future.set_result(None)
    await sending
    assert producer.topics == ["t1.kb.index-hints.gold", "t1.kb.document-events"]
    assert producer.config["security_protocol"] == "SASL_PLAINTEXT"
    assert producer.config["sasl_mechanism"] == "SCRAM-SHA-256"
    assert producer.config["sasl_plain_username"] == "relay"
    assert producer.config["sasl_plain_password"] == "pw"
    assert producer.config["acks"] == "all"
    assert producer.config["enable_idempotence"] is True
    await sink.stop()
