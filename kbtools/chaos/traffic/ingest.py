"""Publishes by event in a chaos run (docs/architecture.md#publish-by-event): a share of
the load's publishes goes as a signed `PublishDocument` command to `kb.ingest.<tier>`
instead of HTTP, the deletes and erases of those documents as `DeleteDocument` and
`EraseDocument` commands, and now and then a poison before a publish
(kbtools/chaos/traffic/poison.py); kbtools/chaos/checks/commands.py checks that every
command sent was applied exactly once.

The driver learns what a command did from its record (`ingest_command`: the document,
version, revision and task), the very row the consumer answers a redelivery from; the
events carry the same command id, but a record read is one query where a consumer of the
events topic would have to ride out the run's broker outages."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kbtools.chaos.rig.topology import KEY_ID, MAX_INLINE_BYTES
from kbtools.chaos.traffic.poison import (
    KINDS,
    POISON_EVERY,
    POISON_HEADER,
    Poison,
    PoisonKind,
    Sent,
    poison_record,
)
from services.publisher.ingest.commands import (
    DELETE_DOCUMENT,
    ERASE_DOCUMENT,
    PUBLISH_DOCUMENT,
    encode_command,
)
from services.publisher.ingest.signing import KEY_ID_HEADER, SIGNATURE_HEADER, sign
from services.runtime.messaging.events import ingest_topic
from services.runtime.pg.sql import queries_beside

SHARE = 0.25  # of the publishes of new documents, those sent as a command
ANSWER_WITHIN_S = 120.0  # as long as the HTTP client retries through an outage

QUERIES = queries_beside(__file__, "traffic.sql")


@dataclass(frozen=True)
class SentCommand:
    tenant_id: str
    command_id: str
    document_key: str
    command_type: str = PUBLISH_DOCUMENT


class IngestProducer:
    """The load driver's producer: an event loop of its own, used from the driver's
    thread only, with one aiokafka producer and the database read of the answers."""

    def __init__(
        self,
        bootstrap: str,
        database_url: str,
        prefix: str,
        keys: Mapping[str, Ed25519PrivateKey],
    ) -> None:
        self.bootstrap = bootstrap
        self.database_url = database_url
        self.prefix = prefix
        self.keys = keys  # each tenant's, registered as KEY_ID (rig/topology.py)
        self.loop = asyncio.new_event_loop()
        self.producer: AIOKafkaProducer | None = None
        self.sent: list[SentCommand] = []
        self.poisons: list[Poison] = []
        self.send_retries = 0
        self.publishes = 0

    def publish(
        self,
        tenant_id: str,
        tier: str,
        document_key: str,
        fields: Mapping[str, Any],
    ) -> dict[str, Any] | None:
        """Send one `PublishDocument` (sent again with the same id after a failure: the
        consumer applies it once), then its answer once applied; None if it was not
        applied within ``ANSWER_WITHIN_S`` (the checker still expects it applied). Each
        ``POISON_EVERY``-th comes right after a poison on its partition."""
        self.publishes += 1
        poison = None
        if self.publishes % POISON_EVERY == POISON_EVERY // 2:
            kind = KINDS[len(self.poisons) % len(KINDS)]
            poison = self._poison(kind, tenant_id, tier, document_key)
        fields = {"upload": None, "expectedRevision": None, **fields}
        return self._command(PUBLISH_DOCUMENT, tenant_id, tier, document_key, fields, poison)

    def remove(
        self, tenant_id: str, tier: str, document_key: str, *, erase: bool
    ) -> dict[str, Any] | None:
        """A `DeleteDocument` (whatever the revision) or an `EraseDocument`, as `publish`;
        its answer carries a ``searchToken``: the primary's WAL position once the command's
        record is read, past its commit."""
        if erase:
            return self._command(ERASE_DOCUMENT, tenant_id, tier, document_key, {}, None)
        fields = {"expectedRevision": None}
        return self._command(DELETE_DOCUMENT, tenant_id, tier, document_key, fields, None)

    def _command(
        self,
        command_type: str,
        tenant_id: str,
        tier: str,
        document_key: str,
        fields: Mapping[str, Any],
        poison: Poison | None,
    ) -> dict[str, Any] | None:
        command_id = uuid.uuid4()
        record = {
            "commandId": command_id,
            "tenantId": tenant_id,
            "documentKey": document_key,
            "issuedAt": datetime.now(UTC),
            **fields,
        }
        value = encode_command(command_type, record)
        key = self.keys[tenant_id]
        headers = [(KEY_ID_HEADER, KEY_ID.encode()), (SIGNATURE_HEADER, sign(key, value))]
        deadline = time.monotonic() + ANSWER_WITHIN_S
        topic = ingest_topic(tier, self.prefix)
        record_key = f"{tenant_id}/{document_key}".encode()
        at = self.loop.run_until_complete(self._send(topic, value, record_key, headers, deadline))
        if at is None:
            return None
        if poison is not None:
            poison.followed_by = (str(command_id), at)
        self.sent.append(SentCommand(tenant_id, str(command_id), document_key, command_type))
        wait_version = command_type == PUBLISH_DOCUMENT
        return self.loop.run_until_complete(
            self._answer(tenant_id, command_id, deadline, wait_version=wait_version)
        )

    def _poison(self, kind: PoisonKind, tenant_id: str, tier: str, key: str) -> Poison | None:
        """A poison of ``kind`` on the partition of ``tenant_id``'s ``key``."""
        command_id, value, headers = poison_record(kind, tenant_id, key, self.keys, KEY_ID)
        poison_id = str(uuid.uuid4())
        headers.append((POISON_HEADER, poison_id.encode()))
        topic = ingest_topic(tier, self.prefix)
        record_key = f"{tenant_id}/{key}".encode()
        deadline = time.monotonic() + ANSWER_WITHIN_S
        at = self.loop.run_until_complete(self._send(topic, value, record_key, headers, deadline))
        if at is None:
            return None
        poison = Poison(poison_id, kind, tenant_id, command_id, at)
        self.poisons.append(poison)
        return poison

    async def _send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]], until: float
    ) -> Sent | None:
        while time.monotonic() < until:
            try:
                if self.producer is None:
                    self.producer = AIOKafkaProducer(
                        bootstrap_servers=self.bootstrap,
                        acks="all",
                        request_timeout_ms=5000,
                        max_request_size=2 * MAX_INLINE_BYTES,  # the too-large poison
                    )
                    await self.producer.start()
                sent = await self.producer.send_and_wait(topic, value, key=key, headers=headers)
                return Sent(topic, sent.partition, sent.offset)
            except (KafkaError, OSError):
                self.send_retries += 1
                await self._drop_producer()
                await asyncio.sleep(1)
        return None

    async def _drop_producer(self) -> None:
        if self.producer is not None:
            producer, self.producer = self.producer, None
            with contextlib.suppress(KafkaError, OSError):
                await producer.stop()

    async def _answer(
        self, tenant_id: str, command_id: uuid.UUID, until: float, *, wait_version: bool
    ) -> dict[str, Any] | None:
        while time.monotonic() < until:
            try:
                conn = await asyncpg.connect(self.database_url, timeout=2)
                try:
                    while time.monotonic() < until:
                        row = await conn.fetchrow(QUERIES["command_answer"], tenant_id, command_id)
                        if row is not None and (row["version_number"] or not wait_version):
                            token = await conn.fetchval(QUERIES["wal_position"])
                            return {**dict(row.items()), "searchToken": token}
                        await asyncio.sleep(0.05)
                finally:
                    await conn.close()
            except (TimeoutError, OSError, asyncpg.PostgresError):
                await asyncio.sleep(0.5)  # the database restarting
        return None

    def close(self) -> None:
        self.loop.run_until_complete(self._drop_producer())
        self.loop.close()
