"""One ingest record: decoded, its signature verified with its tenant's key, then applied;
or, when it can never apply as it is, written to the dead-letter topic with its problem
code. Either way the record is done and its offset may be committed. A transient failure
(``retriable``) is raised: the caller retries the same record, never the next one."""

from __future__ import annotations

import asyncio
import collections
import re
from dataclasses import dataclass

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


class RecordProcessor:
    def __init__(
        self,
        tier: str,
        store: IngestStore,
        applier: IngestApplier,
        dead_letters: DeadLetters,
        metrics: IngestMetrics,
        *,
        max_command_bytes: int,
        max_inline_bytes: int,
        tenant_in_flight: int,
    ) -> None:
        self._tier = tier
        self._store = store
        self._applier = applier
        self._dead_letters = dead_letters
        self._metrics = metrics
        self._max_command_bytes = max_command_bytes
        self._max_inline_bytes = max_inline_bytes
        # Fairness: a tenant's commands hold at most this many transactions at once, so a
        # tenant flooding several partitions leaves the others' partitions their turn.
        self._slots: collections.defaultdict[str, asyncio.Semaphore] = collections.defaultdict(
            lambda: asyncio.Semaphore(tenant_in_flight)
        )

    async def handle(self, record: IngestRecord) -> Handled:
        command_type = UNKNOWN_TYPE
        try:
            value = record.value
            if value is None:
                raise CommandUndecodable("the record has no value")
            if len(value) > self._max_command_bytes:
                raise CommandTooLarge(
                    f"the record has {len(value)} bytes; the limit is {self._max_command_bytes}"
                )
            command = decode_command(value, max_inline_bytes=self._max_inline_bytes)
            command_type = command.command_type
            await self._verify(command.tenant_id, record, value)
            async with self._slots[command.tenant_id]:
                answer = await self._applier.apply(command)
        except KbError as error:
            if error.retriable:
                self._metrics.retries.labels(self._tier, error.code).inc()
                raise
            await self._dead_letters.send(record, error.code, str(error))
            self._metrics.dead_letters.labels(self._tier, error.code).inc()
            self._metrics.commands.labels(self._tier, command_type, error.code).inc()
            log.warning(
                "ingest.dead_lettered",
                tier=self._tier,
                code=error.code,
                partition=record.partition,
                offset=record.offset,
            )
            return Handled(dead_letter_code=error.code)
        result = "applied" if answer.changed else "repeated"
        self._metrics.commands.labels(self._tier, command_type, result).inc()
        log.info(
            "ingest.applied" if answer.changed else "ingest.repeated",
            tier=self._tier,
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
            key = await self._store.ingest_key(tenant_id, raw_key_id)
        verify(key, value, record.headers.get(SIGNATURE_HEADER))
