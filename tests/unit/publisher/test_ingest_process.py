"""One ingest record: applied, or dead-lettered with its code and counted, or raised for a
retry; a tenant's commands hold at most its in-flight cap (docs/architecture.md#publish-by-
event)."""

from __future__ import annotations

import asyncio
import collections
import uuid
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.publisher.domain import RevisionConflict
from services.publisher.ingest.commands import Command
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.ports import CommandAnswer, IngestRecord
from services.publisher.ingest.process import IngestLimits, RecordProcessor
from services.publisher.ingest.signing import IngestKey, public_bytes
from services.runtime.errors import DatabaseUnavailable
from tests.support.ingest import Signer, publish_command


class Keys:
    def __init__(self, *signers: Signer) -> None:
        self._keys = {
            (s.tenant_id, s.key_id): IngestKey(s.key_id, public_bytes(s.private_key))
            for s in signers
        }

    async def ingest_key(self, tenant_id: str, key_id: str) -> IngestKey | None:
        return self._keys.get((tenant_id, key_id))


class Applier:
    """Applies nothing; records what it was given, and may hold a tenant's commands."""

    def __init__(self) -> None:
        self.entered: list[uuid.UUID] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.failure: Exception | None = None
        self.at_once: collections.Counter[str] = collections.Counter()
        self.most_at_once: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Condition()

    async def reached(self, count: int) -> None:
        """Until ``count`` commands have entered."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.entered) >= count)

    async def apply(self, command: Command, sent_at: Any = None) -> CommandAnswer:
        tenant = command.tenant_id
        async with self._changed:
            self.entered.append(command.command_id)
            self._changed.notify_all()
        if self.failure is not None:
            raise self.failure
        self.at_once[tenant] += 1
        self.most_at_once[tenant] = max(self.most_at_once[tenant], self.at_once[tenant])
        gate = self.gates.get(tenant)
        if gate is not None:
            await gate.wait()
        self.at_once[tenant] -= 1
        return CommandAnswer(command.command_id, command.command_type, uuid.uuid4())


class DeadLetters:
    def __init__(self) -> None:
        self.sent: list[tuple[IngestRecord, str]] = []

    async def send(self, record: IngestRecord, code: str, detail: str) -> None:
        self.sent.append((record, code))


def _processor(
    applier: Applier, dead: DeadLetters, *signers: Signer, cap: int = 4, max_bytes: int = 4096
) -> tuple[RecordProcessor, IngestMetrics]:
    metrics = IngestMetrics(CollectorRegistry())
    keys: Any = Keys(*signers)
    limits = IngestLimits(max_bytes, 1024, cap)
    apply: Any = applier
    return RecordProcessor("standard", keys, apply, dead, metrics, limits), metrics


def _record(signer: Signer | None, value: bytes, offset: int = 0) -> IngestRecord:
    headers = dict(signer.headers(value)) if signer is not None else {}
    return IngestRecord("kb.ingest.standard", 0, offset, b"key", value, headers)


def _count(metrics: IngestMetrics, result: str) -> float:
    value: float = metrics.commands.labels("standard", "PublishDocument", result)._value.get()
    return value


async def test_a_signed_command_is_applied_and_counted() -> None:
    acme = Signer("acme")
    applier, dead = Applier(), DeadLetters()
    processor, metrics = _processor(applier, dead, acme)
    command_id = uuid.uuid4()
    handled = await processor.handle(
        _record(acme, publish_command("acme", "k", command_id=command_id))
    )
    assert handled.answer is not None
    assert applier.entered == [command_id]
    assert _count(metrics, "applied") == 1
    assert dead.sent == []


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (None, "INGEST_COMMAND_UNDECODABLE"),
        (b"x" * 5000, "INGEST_COMMAND_TOO_LARGE"),
        (b"garbage", "INGEST_COMMAND_UNDECODABLE"),
    ],
)
async def test_what_cannot_apply_goes_dead_with_its_code(value: bytes | None, code: str) -> None:
    acme = Signer("acme")
    applier, dead = Applier(), DeadLetters()
    processor, metrics = _processor(applier, dead, acme)
    record = IngestRecord("kb.ingest.standard", 0, 7, b"key", value, {})
    handled = await processor.handle(record)
    assert handled.dead_letter_code == code
    assert dead.sent == [(record, code)]
    assert metrics.dead_letters.labels("standard", code)._value.get() == 1
    assert applier.entered == []


async def test_a_command_signed_by_another_tenant_is_never_applied() -> None:
    acme, beta = Signer("acme"), Signer("beta")
    applier, dead = Applier(), DeadLetters()
    processor, _ = _processor(applier, dead, acme, beta)
    forged = publish_command("beta", "k")
    assert (await processor.handle(_record(acme, forged))).dead_letter_code == (
        "INGEST_SIGNATURE_INVALID"
    )
    assert (await processor.handle(_record(None, forged))).dead_letter_code == (
        "INGEST_SIGNATURE_INVALID"
    )
    assert applier.entered == []


async def test_a_refusal_of_the_publish_goes_dead_a_transient_failure_is_raised() -> None:
    acme = Signer("acme")
    applier, dead = Applier(), DeadLetters()
    processor, metrics = _processor(applier, dead, acme)
    applier.failure = DatabaseUnavailable("the database is away")
    record = _record(acme, publish_command("acme", "k"))
    with pytest.raises(DatabaseUnavailable):
        await processor.handle(record)
    assert dead.sent == []
    assert metrics.retries.labels("standard", "DATABASE_UNAVAILABLE")._value.get() == 1
    applier.failure = RevisionConflict(1, 2)
    assert (await processor.handle(record)).dead_letter_code == "REVISION_CONFLICT"


async def test_a_tenant_holds_at_most_its_in_flight_cap_while_others_go_on() -> None:
    acme, beta = Signer("acme"), Signer("beta")
    applier, dead = Applier(), DeadLetters()
    processor, _ = _processor(applier, dead, acme, beta, cap=2)
    applier.gates["acme"] = asyncio.Event()
    flood = [
        asyncio.create_task(processor.handle(_record(acme, publish_command("acme", f"p{n}"))))
        for n in range(10)
    ]
    await applier.reached(2)  # acme's two slots are taken, and held
    other = await processor.handle(_record(beta, publish_command("beta", "c")))
    assert other.answer is not None
    # Beta's command went through; no third acme command got into a transaction.
    assert len(applier.entered) == 3
    applier.gates["acme"].set()
    await asyncio.gather(*flood)
    assert len(applier.entered) == 11
    assert applier.most_at_once["acme"] == 2
