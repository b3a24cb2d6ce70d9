"""One ingest record: decoded, its signature verified with its tenant's key, then applied;
or, when it can never apply as it is, written to the dead-letter topic with its problem
code. Either way the record is done and its offset may be committed. A transient failure
(``retriable``) is raised: the caller retries the same record, never the next one."""

from __future__ import annotations

import asyncio
import collections
import re
from dataclasses import dataclass, field

from services.publisher.ingest.apply import IngestApplier
from services.publisher.ingest.commands import CommandTooLarge, CommandUndecodable, decode_command
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.ports import CommandAnswer, DeadLetters, IngestRecord, IngestStore
from services.publisher.ingest.signing import (
    KEY_ID_HEADER,
    KEY_ID_PATTERN,
    SIGNATURE_HEADER,
    verify,
)
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)

UNKNOWN_TYPE = "unknown"


@dataclass(frozen=True)
class Handled:
    """What became of a record: its answer, or the problem code it was dead-lettered with."""

    answer: CommandAnswer | None = None
    dead_letter_code: str | None = None


@dataclass(frozen=True)
class IngestLimits:
    max_command_bytes: int
    max_inline_bytes: int
    # Fairness: a tenant's commands hold at most this many transactions at once, so a
    # tenant flooding several partitions leaves the others' partitions their turn.
    tenant_in_flight: int


@dataclass
class RecordProcessor:
    tier: str
    store: IngestStore
    applier: IngestApplier
    dead_letters: DeadLetters
    metrics: IngestMetrics
    limits: IngestLimits
    _slots: collections.defaultdict[str, asyncio.Semaphore] = field(init=False)

    def __post_init__(self) -> None:
        cap = self.limits.tenant_in_flight
        self._slots = collections.defaultdict(lambda: asyncio.Semaphore(cap))

    async def handle(self, record: IngestRecord) -> Handled:
        command_type = UNKNOWN_TYPE
        try:
            value = record.value
            if value is None:
                raise CommandUndecodable("the record has no value")
            limit = self.limits.max_command_bytes
            if len(value) > limit:
                raise CommandTooLarge(f"the record has {len(value)} bytes; the limit is {limit}")
            command = decode_command(value, max_inline_bytes=self.limits.max_inline_bytes)
            command_type = command.command_type
            await self._verify(command.tenant_id, record, value)
            async with self._slots[command.tenant_id]:
                answer = await self.applier.apply(command, sent_at=record.sent_at)
        except KbError as error:
            if error.retriable:
                self.metrics.retries.labels(self.tier, error.code).inc()
                raise
            await self.dead_letters.send(record, error.code, str(error))
            self.metrics.dead_letters.labels(self.tier, error.code).inc()
            self.metrics.commands.labels(self.tier, command_type, error.code).inc()
            fields = record.log_fields(tier=self.tier, code=error.code)
            log.warning("ingest.dead_lettered", **fields)
            return Handled(dead_letter_code=error.code)
        result = "applied" if answer.changed else "repeated"
        self.metrics.commands.labels(self.tier, command_type, result).inc()
        log.info(
            "ingest.applied" if answer.changed else "ingest.repeated",
            tier=self.tier,
            tenant_id=command.tenant_id,
            command_id=str(answer.command_id),
            command_type=command_type,
            document_id=str(answer.document_id),
        )
        return Handled(answer=answer)

    async def _verify(self, tenant_id: str, record: IngestRecord, value: bytes) -> None:
        raw_key_id = record.headers.get(KEY_ID_HEADER, b"").decode("utf-8", "replace")
        key = None
        if re.fullmatch(KEY_ID_PATTERN, raw_key_id):
            key = await self.store.ingest_key(tenant_id, raw_key_id)
        verify(key, value, record.headers.get(SIGNATURE_HEADER))
