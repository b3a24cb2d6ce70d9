"""What the ingest consumer needs from storage and from Kafka, as Protocols."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from services.publisher.bulk.domain import BulkStore
from services.publisher.ingest.commands import Command
from services.publisher.ingest.signing import IngestKey
from services.publisher.ports import PublisherStore, PublishTransaction


@dataclass(frozen=True)
class CommandAnswer:
    """What a command did, as recorded with it: a redelivered command answers the same."""

    command_id: uuid.UUID
    command_type: str
    document_id: uuid.UUID | None
    version_number: int | None = None
    revision: int | None = None
    task_id: uuid.UUID | None = None
    # False when the command was applied before (a redelivery): nothing was written now.
    changed: bool = True

    def stored(self) -> tuple[object, ...]:
        """What ``ingest_command`` keeps of it, in its columns' order (ingest.sql)."""
        return (self.command_id, self.document_id, self.version_number, self.revision, self.task_id)


@dataclass(frozen=True)
class IngestRecord:
    """One record of an ingest topic, as read (the value unread, the headers raw)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes] = field(default_factory=dict)
    sent_at: datetime | None = None  # the record's Kafka timestamp

    @property
    def source(self) -> str:
        """Where it was read: a dead letter's ``kb-source`` header."""
        return f"{self.topic}/{self.partition}/{self.offset}"

    def log_fields(self, **more: object) -> dict[str, object]:
        """Where the record was read, for a log line, with ``more``."""
        return {"partition": self.partition, "offset": self.offset, **more}


# Commands to claim, each with when its record reached Kafka.
Claims = Sequence[tuple[Command, datetime | None]]


class IngestTransaction(PublishTransaction, Protocol):
    async def claim_command(
        self, command: Command, now: datetime | None, sent_at: datetime | None
    ) -> bool:
        """Record the command's id in its tenant (its answer still empty); False when it is
        recorded already. A concurrent transaction claiming the same id waits for this one.
        ``sent_at``: when its record reached Kafka."""
        ...

    async def command_answer(
        self, tenant_id: str, command_id: uuid.UUID
    ) -> CommandAnswer | None: ...

    async def command_answers(
        self, tenant_id: str, command_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, CommandAnswer]:
        """The answers of those of ``command_ids`` applied before."""
        ...

    def savepoint(self) -> AbstractAsyncContextManager[None]:
        """What the block writes is undone, and the transaction goes on, when it raises."""
        ...

    async def documents_for_keys(
        self, tenant_id: str, document_keys: Sequence[str]
    ) -> dict[str, uuid.UUID]:
        """Those of ``document_keys`` mapped to a document, with it."""
        ...

    async def claim_commands(self, tenant_id: str, claims: Claims, now: datetime | None) -> int:
        """``claim_command`` for each (with when its record reached Kafka); how many were
        claimed now (the others were recorded already)."""
        ...

    async def map_keys(
        self, tenant_id: str, pairs: Sequence[tuple[str, uuid.UUID]], now: datetime | None
    ) -> None:
        """Map keys no document has to new documents."""
        ...

    async def record_answers(self, tenant_id: str, answers: Sequence[CommandAnswer]) -> None: ...

    def bulk(self) -> BulkStore:
        """The bulk endpoint's writes, in this transaction (new documents together)."""
        ...

    async def refusals_sent(self, tenant_id: str, sources: Sequence[str]) -> dict[str, str]:
        """Those of ``sources`` (``IngestRecord.source``) whose dead letter was recorded,
        each with the problem code it was refused with."""
        ...

    async def record_refusal(
        self, tenant_id: str, source: str, command_id: uuid.UUID, code: str, now: datetime | None
    ) -> None: ...

    async def record_answer(self, tenant_id: str, answer: CommandAnswer) -> None: ...

    async def document_for_key(self, tenant_id: str, document_key: str) -> uuid.UUID | None: ...

    async def forget_key(self, tenant_id: str, document_key: str) -> None:
        """Drop the key's mapping (its document was deleted: the key maps anew)."""
        ...

    async def forget_document_key(self, tenant_id: str, document_id: uuid.UUID) -> None:
        """Drop an erased document's key: a producer's key may be personal data."""
        ...

    async def map_key(
        self, tenant_id: str, document_key: str, document_id: uuid.UUID, now: datetime | None
    ) -> None:
        """Map the producer's key to the document; ``DocumentKeyTaken`` when the document
        has another key."""
        ...


class IngestStore(PublisherStore, Protocol):
    def ingest_transaction(self, tenant_id: str) -> AbstractAsyncContextManager[IngestTransaction]:
        """A tenant's transaction (behind the wall) that can also record commands."""
        ...

    async def tenant_tier(self, tenant_id: str) -> str | None:
        """The tenant's tier; None when there is no such tenant."""
        ...

    async def ingest_keys(self, tenant_id: str, key_ids: Sequence[str]) -> dict[str, IngestKey]:
        """The tenant's ingest keys of those ids, by id, unless revoked."""
        ...


class IngestKeyRegistry(Protocol):
    """A tenant's ingest keys as its admin key manages them (the API: behind the wall)."""

    async def add_ingest_key(
        self, tenant_id: str, key_id: str, public_key: bytes
    ) -> datetime | None:
        """When the key was added; None when the tenant has a key of that id already."""
        ...

    async def list_ingest_keys(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's keys, revoked ones included, oldest first: ``key_id``,
        ``public_key`` (raw bytes), ``created_at``, ``revoked_at``."""
        ...

    async def revoke_ingest_key(self, tenant_id: str, key_id: str) -> datetime | None:
        """When the key was revoked; None when the tenant has no live key of that id."""
        ...


@dataclass(frozen=True)
class Backlog:
    """A tenant's records a process holds, fetched and not yet applied."""

    records: int
    oldest_sent_at: datetime | None  # the earliest Kafka timestamp among them


class BacklogReports(Protocol):
    async def report_backlog(
        self, tier: str, consumer_id: uuid.UUID, held: dict[str, Backlog]
    ) -> None:
        """Replace what this process reported it holds (the operator page reads it)."""
        ...


class Retained(Protocol):
    """The ingest records kept for a horizon (retention.py). Each deletes at most ``most``
    records older than ``days`` days before ``now`` (None: the database's clock), every
    tenant's, and says how many went."""

    async def remove_refusals(self, days: int, most: int, now: datetime | None = None) -> int:
        """Refused commands' records (``ingest_refusal``)."""
        ...

    async def remove_commands(self, days: int, most: int, now: datetime | None = None) -> int:
        """Applied commands' records (``ingest_command``), but those whose index task is
        still to run."""
        ...


class DeadLetters(Protocol):
    async def send(self, record: IngestRecord, code: str, detail: str) -> None:
        """Write ``record`` (its bytes, key and headers) to the tier's dead-letter topic
        with the problem code, and wait for the broker's acknowledgement."""
        ...
