"""The aiokafka side of `kb ingest`: the tier's consumer group, the dead-letter producer.

Never skip (the relay's rule, services/relay/outbox_pg.py, the other way round): an offset
is committed only after its record is done -- its transaction committed, or its dead letter
acknowledged by the broker -- and only up to the first record not done. A transient failure
retries the same record with backoff; a crash anywhere redelivers from the last commit, and
a command applied before answers from its record (services/publisher/ingest/apply.py).
The partitions of one batch are handled side by side, each in its offset order: a
document's commands share a partition (the producer keys them by tenant and document), so
they apply in the order sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
)

from services.publisher.ingest.ports import IngestRecord
from services.publisher.ingest.settings import IngestSettings
from services.runtime.backoff import Backoff
from services.runtime.errors import KafkaUnavailable
from services.runtime.logging import get_logger
from services.runtime.messaging.events import ingest_dead_topic
from services.runtime.messaging.kafka import kafka_client_kwargs
from services.runtime.signals import ignoring_foreign_cancellation

log = get_logger(__name__)

PROBLEM_CODE_HEADER = "kb-problem-code"
PROBLEM_DETAIL_HEADER = "kb-problem-detail"
SOURCE_HEADER = "kb-source"  # topic/partition/offset the dead letter was read at
DEAD_LETTER_HEADERS = frozenset({PROBLEM_CODE_HEADER, PROBLEM_DETAIL_HEADER, SOURCE_HEADER})
MAX_DETAIL_CHARS = 1000

T = TypeVar("T")


def to_record(message: Any) -> IngestRecord:
    headers = {k: v for k, v in (message.headers or ()) if isinstance(v, bytes)}
    sent_at = None
    if message.timestamp is not None and message.timestamp >= 0:
        sent_at = datetime.fromtimestamp(message.timestamp / 1000, UTC)
    return IngestRecord(
        message.topic,
        message.partition,
        message.offset,
        message.key,
        message.value,
        headers,
        sent_at,
    )


async def start_when_reachable(
    start: Callable[[], Awaitable[None]], stop: asyncio.Event, backoff: Backoff, *, client: str
) -> bool:
    """Start a Kafka client, again after a backoff while the broker is unreachable: a
    process started during an outage waits for the broker, as the relay does, instead of
    exiting. False when stopped first."""
    failures = 0
    while not stop.is_set():
        try:
            await start()
            return True
        except KafkaConnectionError as error:
            failures += 1
            log.warning(
                "ingest.kafka_unreachable", client=client, failures=failures, error=str(error)
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.delay(failures))
    return False


async def create_topics(settings: IngestSettings, names: Iterable[str]) -> None:
    """Create ``names`` unless they exist; a broker that forbids it is logged, not fatal
    (the topics are then the operator's to create)."""
    admin = AIOKafkaAdminClient(**kafka_client_kwargs(settings))
    try:
        await admin.start()
        for name in names:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [NewTopic(name, settings.ingest_topic_partitions, replication_factor=1)]
                )
    except KafkaError as error:
        log.warning("ingest.topics_not_created", error=type(error).__name__)
    finally:
        await admin.close()


class KafkaDeadLetters:
    """The tier's dead-letter topic: the record's key, value and headers as read, plus the
    problem and where it was read, so `kb ingest replay-dead` can apply it again."""

    def __init__(self, settings: IngestSettings, tier: str) -> None:
        self._topic = ingest_dead_topic(tier, settings.kafka_topic_prefix)
        self._producer = AIOKafkaProducer(
            acks="all", enable_idempotence=True, **kafka_client_kwargs(settings)
        )

    async def start(self) -> None:
        await self._producer.start()

    async def close(self) -> None:
        await ignoring_foreign_cancellation(self._producer.stop())

    async def send(self, record: IngestRecord, code: str, detail: str) -> None:
        headers = [(k, v) for k, v in record.headers.items() if k not in DEAD_LETTER_HEADERS]
        headers += [
            (PROBLEM_CODE_HEADER, code.encode()),
            (PROBLEM_DETAIL_HEADER, detail[:MAX_DETAIL_CHARS].encode("utf-8", "replace")),
            (SOURCE_HEADER, record.source.encode()),
        ]
        try:
            await self._producer.send_and_wait(
                self._topic, record.value, key=record.key, headers=headers
            )
        except KafkaError as error:
            raise KafkaUnavailable(f"the dead letter was not acknowledged: {error!r}") from error
