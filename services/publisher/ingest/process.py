"""Ingest records: decoded, their signatures verified with their tenants' keys (kept a short
while, key_cache.py), then applied a tenant's run at a time, one transaction each; or, when
one can never apply as it is, written to the dead-letter topic with its problem code.
Either way the record is done and its offset may be committed. A transient failure
(``retriable``) is raised: the caller retries the same records, never the next ones."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from opentelemetry.trace import SpanKind

from services.publisher.ingest.commands import (
    Command,
    CommandTooLarge,
    CommandUndecodable,
    EraseDocument,
    decode_command,
)
from services.publisher.ingest.key_cache import KeyCache
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.ports import CommandAnswer, DeadLetters, IngestRecord, IngestStore
from services.publisher.ingest.runs import Arrived, RunApplier
from services.publisher.ingest.signing import (
    KEY_ID_HEADER,
    KEY_ID_PATTERN,
    SIGNATURE_HEADER,
    IngestKey,
    SignatureInvalid,
    verify,
)
from services.runtime.errors import KbError
from services.runtime.logging import get_logger
from services.runtime.tracing.propagation import TRACEPARENT
from services.runtime.tracing.spans import TENANT_ID, annotate, span_under

log = get_logger(__name__)

UNKNOWN_TYPE = "unknown"
T = TypeVar("T")


@dataclass(frozen=True)
class Handled:
    """What became of a record: its answer, or the problem code it was dead-lettered with."""

    answer: CommandAnswer | None = None
    dead_letter_code: str | None = None


class Verified(NamedTuple):
    """A record whose command decoded and whose signature verified with its tenant's key."""

    record: IngestRecord
    command: Command


@dataclass(frozen=True)
class Refusal:
    """A record that can never apply as it is, and why (its dead letter's code)."""

    error: KbError
    record: IngestRecord
    command_type: str = UNKNOWN_TYPE


@dataclass(frozen=True)
class IngestLimits:
    max_command_bytes: int
    max_inline_bytes: int
    # Fairness: a tenant's commands hold at most this many transactions at once, so a
    # tenant flooding several partitions leaves the others' partitions their turn.
    tenant_in_flight: int
    # KB_INGEST_KEY_CACHE_SECONDS: how long a key read is trusted (a revocation's bound).
    key_cache_seconds: float = 10.0


@dataclass
class RecordProcessor:
    tier: str
    store: IngestStore
    applier: RunApplier
    dead_letters: DeadLetters
    metrics: IngestMetrics
    limits: IngestLimits
    _slots: TenantSlots = field(init=False)
    _keys: KeyCache = field(init=False)
    # Dead letters sent in a run whose transaction did not commit (a retriable failure
    # after them): its retry records them without sending them again.
    _sent: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._slots = TenantSlots(self.limits.tenant_in_flight)
        self._keys = KeyCache(self.store.ingest_keys, self.limits.key_cache_seconds)

    def tenants_in_flight(self) -> set[str]:
        """The tenants whose slots are kept: those with a command holding or awaiting one."""
        return self._slots.tenants()

    async def handle(self, record: IngestRecord) -> Handled:
        """One record, start to end (what a run of one does)."""
        verified, refused = await self.sort([record])
        for refusal in refused:
            await self.dead_letter(refusal)
            return Handled(dead_letter_code=refusal.error.code)
        return (await self.apply(verified))[0]

    async def sort(self, records: Sequence[IngestRecord]) -> tuple[list[Verified], list[Refusal]]:
        """The records whose commands verified, in order, and those refused unread or
        unverified; the keys each tenant's lack read at once. Sends nothing."""
        decoded: list[tuple[IngestRecord, Command]] = []
        refused: list[Refusal] = []
        for record in records:
            try:
                decoded.append((record, self._decode(record)))
            except KbError as error:
                refused.append(Refusal(error, record))
        wanted: dict[str, list[str]] = collections.defaultdict(list)
        for record, command in decoded:
            wanted[command.tenant_id].append(_key_id(record))
        keys = {
            tenant: await self._retried(self._keys.keys(tenant, ids))
            for tenant, ids in wanted.items()
        }
        signed = [
            (keys[command.tenant_id].get(_key_id(record)), record.value or b"", record.headers)
            for record, command in decoded
        ]
        # In a worker thread, all at once: the Ed25519 library lets go of the interpreter
        # while it verifies, so the loop applies the runs before these meanwhile.
        failures = await asyncio.to_thread(_verify_each, signed)
        verified: list[Verified] = []
        for (record, command), failure in zip(decoded, failures, strict=True):
            if failure is not None:
                refused.append(Refusal(failure, record, command.command_type))
            else:
                verified.append(Verified(record, command))
        return verified, refused

    async def apply(self, run: Sequence[Verified]) -> list[Handled]:
        """One tenant's ``run``, in one transaction (an erase: alone, in its own)."""
        tenant = run[0].command.tenant_id
        async with self._slots.taken(tenant):
            revoked = await self._revoked(tenant, run)
            if isinstance(run[0].command, EraseDocument):
                assert len(run) == 1
                if revoked:
                    return [await self._refused(run[0], revoked[0])]
                return [await self._erase(run[0])]
            handled: dict[int, Handled] = {}

            async def refuse(n: int, error: KbError) -> None:
                refusal = Refusal(error, run[n].record, run[n].command.command_type)
                if refusal.record.source not in self._sent:
                    await self.dead_letter(refusal)
                    self._sent.add(refusal.record.source)
                handled[n] = Handled(dead_letter_code=error.code)

            def refused_before(n: int, code: str) -> None:
                handled[n] = Handled(dead_letter_code=code)

            arrived = [Arrived(v.command, v.record.source, v.record.sent_at) for v in run]
            answers = await self._retried(
                self.applier.apply_run(
                    arrived,
                    refuse,
                    refusing=revoked,
                    refused_before=refused_before,
                    around=lambda n: self._span(run[n]),
                )
            )
        self._sent.difference_update(item.source for item in arrived)
        for n, answer in enumerate(answers):
            if answer is not None:
                handled[n] = self._applied(run[n], answer)
        return [handled[n] for n in range(len(run))]

    async def _revoked(self, tenant: str, run: Sequence[Verified]) -> dict[int, KbError]:
        """The run's commands whose key is no longer the tenant's. A record verified when it
        was fetched may wait in its lane, or through retries, for longer than the key cache
        is trusted: its key is asked again (through the cache) at every attempt to apply it,
        so a revocation stops it within KB_INGEST_KEY_CACHE_SECONDS however long it waited."""
        ids = sorted({_key_id(item.record) for item in run})
        live = await self._retried(self._keys.keys(tenant, ids))
        return {
            n: SignatureInvalid("the command's ingest key was revoked before it applied")
            for n, item in enumerate(run)
            if _key_id(item.record) not in live
        }

    async def _refused(self, item: Verified, error: KbError) -> Handled:
        await self.dead_letter(Refusal(error, item.record, item.command.command_type))
        return Handled(dead_letter_code=error.code)

    async def dead_letter(self, refusal: Refusal) -> None:
        error, record = refusal.error, refusal.record
        await self._retried(self.dead_letters.send(record, error.code, str(error)))
        self.metrics.dead_letters.labels(self.tier, error.code).inc()
        self.metrics.commands.labels(self.tier, refusal.command_type, error.code).inc()
        log.warning("ingest.dead_lettered", **record.log_fields(tier=self.tier, code=error.code))

    async def _erase(self, item: Verified) -> Handled:
        try:
            with self._span(item):
                answer = await self._retried(
                    self.applier.single.apply(item.command, sent_at=item.record.sent_at)
                )
        except KbError as error:
            if error.retriable:
                raise
            return await self._refused(item, error)
        return self._applied(item, answer)

    def _applied(self, item: Verified, answer: CommandAnswer) -> Handled:
        command_type = item.command.command_type
        result = "applied" if answer.changed else "repeated"
        self.metrics.commands.labels(self.tier, command_type, result).inc()
        log.info(
            "ingest.applied" if answer.changed else "ingest.repeated",
            tier=self.tier,
            tenant_id=item.command.tenant_id,
            command_id=str(answer.command_id),
            command_type=command_type,
            document_id=str(answer.document_id),
        )
        return Handled(answer=answer)

    async def _retried(self, step: Awaitable[T]) -> T:
        """``step``, its transient failure counted before it is raised for a retry."""
        try:
            return await step
        except KbError as error:
            if error.retriable:
                self.metrics.retries.labels(self.tier, error.code).inc()
            raise

    @contextlib.contextmanager
    def _span(self, item: Verified) -> Iterator[None]:
        # The producer's trace goes on (its ``traceparent`` header): the rows the command
        # writes store this span's context, so the indexer's attempt joins the same trace.
        record = item.record
        with span_under(
            f"process {record.topic}",
            record.headers.get(TRACEPARENT),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": record.topic,
                "messaging.destination.partition.id": str(record.partition),
                "messaging.kafka.offset": record.offset,
            },
        ):
            annotate(
                {TENANT_ID: item.command.tenant_id, "kb.command_id": str(item.command.command_id)}
            )
            yield

    def _decode(self, record: IngestRecord) -> Command:
        value = record.value
        if value is None:
            raise CommandUndecodable("the record has no value")
        limit = self.limits.max_command_bytes
        if len(value) > limit:
            raise CommandTooLarge(f"the record has {len(value)} bytes; the limit is {limit}")
        return decode_command(value, max_inline_bytes=self.limits.max_inline_bytes)


class TenantSlots:
    """At most ``cap`` transactions per tenant at once. A tenant's semaphore is made when
    one of its commands first asks for a slot and dropped once none holds or awaits one, so
    the process keeps one per tenant at work, not one per tenant ever seen."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        # tenant -> its semaphore and how many commands hold or await it
        self._kept: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def taken(self, tenant: str) -> AsyncIterator[None]:
        semaphore, users = self._kept.get(tenant, (None, 0))
        if semaphore is None:
            semaphore = asyncio.Semaphore(self._cap)
        self._kept[tenant] = (semaphore, users + 1)
        try:
            async with semaphore:
                yield
        finally:
            semaphore, users = self._kept[tenant]
            if users == 1:
                del self._kept[tenant]
            else:
                self._kept[tenant] = (semaphore, users - 1)

    def tenants(self) -> set[str]:
        return set(self._kept)


def _verify_each(
    signed: Sequence[tuple[IngestKey | None, bytes, Mapping[str, bytes]]],
) -> list[KbError | None]:
    """Each record's refusal (its signature does not verify), or None."""
    failures: list[KbError | None] = []
    for key, value, headers in signed:
        try:
            verify(key, value, headers.get(SIGNATURE_HEADER))
        except KbError as error:
            failures.append(error)
        else:
            failures.append(None)
    return failures


def _key_id(record: IngestRecord) -> str:
    """The record's ``kb-key-id``; empty when it is no key id (no key has it)."""
    raw = record.headers.get(KEY_ID_HEADER, b"").decode("utf-8", "replace")
    return raw if re.fullmatch(KEY_ID_PATTERN, raw) else ""
