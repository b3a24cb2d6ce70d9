"""One ingest record: applied, or dead-lettered with its code and counted, or raised for a
retry; a tenant's commands hold at most its in-flight cap (docs/architecture.md#publish-by-
event)."""

from __future__ import annotations

import asyncio
import collections
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from services.publisher.domain import RevisionConflict
from services.publisher.ingest.commands import Command, decode_command
from services.publisher.ingest.metrics import IngestMetrics
from services.publisher.ingest.pipeline import coalesce, tenant_runs
from services.publisher.ingest.ports import CommandAnswer, IngestRecord
from services.publisher.ingest.process import IngestLimits, RecordProcessor, Verified
from services.publisher.ingest.runs import Around, Arrived, Refuse, RefusedBefore
from services.publisher.ingest.signing import IngestKey, public_bytes, verify
from services.runtime.errors import DatabaseUnavailable, KbError
from services.runtime.tracing.propagation import TRACEPARENT, current_traceparent, traceparent_of
from services.runtime.tracing.spans import span_under
from tests.support.ingest import Signer, erase_command, publish_command
from tests.support.tracing import one, parent_id, trace_id, traced

# Only a safety net for a regression (verification back on the loop): it never paces a test.
_DEADLOCK_SECONDS = 30.0


class Keys:
    def __init__(self, *signers: Signer) -> None:
        self._keys = {
            (s.tenant_id, s.key_id): IngestKey(s.key_id, public_bytes(s.private_key))
            for s in signers
        }

    def revoke(self, tenant_id: str, key_id: str) -> None:
        del self._keys[(tenant_id, key_id)]

    async def ingest_keys(self, tenant_id: str, key_ids: list[str]) -> dict[str, IngestKey]:
        found = {k: self._keys.get((tenant_id, k)) for k in key_ids}
        return {k: key for k, key in found.items() if key is not None}


class Applier:
    """Applies nothing; records what it was given, and may hold a tenant's commands."""

    def __init__(self) -> None:
        self.entered: list[uuid.UUID] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.failure: Exception | None = None
        self.single = self  # an erase: applied alone
        # Commands refused when their run ran before (a redelivery), with their codes.
        self.refused_earlier: dict[uuid.UUID, str] = {}
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

    async def apply_run(
        self,
        run: list[Arrived],
        refuse: Refuse,
        *,
        refusing: Mapping[int, KbError],
        refused_before: RefusedBefore,
        around: Around,
    ) -> list[CommandAnswer | None]:
        """What the applier's run does, one command at a time."""
        answers: list[CommandAnswer | None] = []
        for n, item in enumerate(run):
            code = self.refused_earlier.get(item.command.command_id)
            if code is not None:
                refused_before(n, code)
                answers.append(None)
                continue
            if n in refusing:
                await refuse(n, refusing[n])
                answers.append(None)
                continue
            try:
                with around(n):
                    answers.append(await self.apply(item.command, item.sent_at))
            except KbError as error:
                if error.retriable:
                    raise
                await refuse(n, error)
                answers.append(None)
        return answers


class DeadLetters:
    def __init__(self) -> None:
        self.sent: list[tuple[IngestRecord, str]] = []

    async def send(self, record: IngestRecord, code: str, detail: str) -> None:
        self.sent.append((record, code))


def _processor(
    applier: Applier,
    dead: DeadLetters,
    *signers: Signer,
    cap: int = 4,
    max_bytes: int = 4096,
    key_cache_seconds: float = 10.0,
) -> tuple[RecordProcessor, IngestMetrics]:
    metrics = IngestMetrics(CollectorRegistry())
    keys: Any = Keys(*signers)
    limits = IngestLimits(max_bytes, 1024, cap, key_cache_seconds)
    apply: Any = applier
    return RecordProcessor("standard", keys, apply, dead, metrics, limits), metrics


def _record(signer: Signer | None, value: bytes, offset: int = 0) -> IngestRecord:
    headers = dict(signer.headers(value)) if signer is not None else {}
    return IngestRecord("kb.ingest.standard", 0, offset, b"key", value, headers)


def _count(metrics: IngestMetrics, result: str) -> float:
    return float(metrics.commands.labels("standard", "PublishDocument", result)._value.get())


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


async def test_a_command_refused_when_its_run_ran_before_answers_its_code_again() -> None:
    """A run redelivered after its commit (a kill before the offset commit): the command it
    refused then answers with that code, its dead letter not sent again, the rest apply."""
    acme = Signer("acme")
    applier, dead = Applier(), DeadLetters()
    processor, _ = _processor(applier, dead, acme)
    poison, next_one = uuid.uuid4(), uuid.uuid4()
    applier.refused_earlier[poison] = "PRINCIPAL_INVALID"
    records = [
        _record(acme, publish_command("acme", "p", command_id=poison), offset=1),
        _record(acme, publish_command("acme", "n", command_id=next_one), offset=2),
    ]
    verified, refused = await processor.sort(records)
    assert refused == []
    handled = await processor.apply(verified)
    assert handled[0].dead_letter_code == "PRINCIPAL_INVALID"
    assert handled[1].answer is not None
    assert dead.sent == []
    assert applier.entered == [next_one]


async def test_a_key_revoked_after_its_commands_verified_stops_them_before_they_apply() -> None:
    """Records verified when fetched wait in their lane (or through retries): their key is
    asked again when they apply, so a revocation holds within the key cache's bound (here
    0: at once) however long they waited."""
    acme = Signer("acme")
    applier, dead = Applier(), DeadLetters()
    processor, _ = _processor(applier, dead, acme, key_cache_seconds=0)
    records = [
        _record(acme, publish_command("acme", "p"), offset=1),
        _record(acme, erase_command("acme", "p"), offset=2),
    ]
    verified, refused = await processor.sort(records)
    assert (len(verified), refused) == (2, [])
    processor.store.revoke("acme", acme.key_id)  # type: ignore[attr-defined]
    handled = [*await processor.apply(verified[:1]), *await processor.apply(verified[1:])]
    assert [h.dead_letter_code for h in handled] == ["INGEST_SIGNATURE_INVALID"] * 2
    assert [code for _, code in dead.sent] == ["INGEST_SIGNATURE_INVALID"] * 2
    assert applier.entered == []


async def test_signatures_are_verified_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Ed25519 library lets go of the interpreter while it verifies: in a worker thread,
    # the loop applies earlier runs meanwhile. The stand-in blocks until the loop answers,
    # so it only finishes if the loop keeps running while it verifies.
    acme = Signer("acme")
    processor, _ = _processor(Applier(), DeadLetters(), acme)
    started, release = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    real = verify

    def blocking_verify(key: IngestKey | None, value: bytes, signature: bytes | None) -> None:
        threads.append(threading.current_thread())
        started.set()
        if not release.wait(_DEADLOCK_SECONDS):
            raise AssertionError("the event loop was blocked by the verification")
        real(key, value, signature)

    monkeypatch.setattr("services.publisher.ingest.process.verify", blocking_verify)
    records = [_record(acme, publish_command("acme", "a"), 0), _record(None, b"x", 1)]
    sorting = asyncio.create_task(processor.sort(records))
    await asyncio.to_thread(started.wait, _DEADLOCK_SECONDS)
    release.set()
    verified, refused = await sorting
    assert [v.record.offset for v in verified] == [0]
    assert [r.record.offset for r in refused] == [1]
    assert threads
    assert threading.main_thread() not in threads


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


async def test_a_command_continues_its_producers_trace_and_its_rows_store_the_span() -> None:
    acme = Signer("acme")
    stored: list[str | None] = []

    class Storing(Applier):
        async def apply(self, command: Command, sent_at: Any = None) -> CommandAnswer:
            stored.append(current_traceparent())  # what the outbox and task rows would keep
            return await super().apply(command, sent_at)

    processor, _ = _processor(Storing(), DeadLetters(), acme)
    value = publish_command("acme", "k")
    with traced() as exporter:
        with span_under("producer", None) as producer:
            header = current_traceparent()
        assert header is not None
        record = _record(acme, value)
        record.headers[TRACEPARENT] = header.encode()
        await processor.handle(record)
        spans = exporter.get_finished_spans()
    consumer = one(spans, "process kb.ingest.standard")
    assert consumer.kind is SpanKind.CONSUMER
    assert parent_id(consumer) == producer.get_span_context().span_id
    assert trace_id(consumer) == producer.get_span_context().trace_id
    assert consumer.attributes is not None
    assert consumer.attributes["kb.tenant_id"] == "acme"
    assert consumer.context is not None
    assert stored == [traceparent_of(consumer.context)]


def _verified(tenant: str, command: bytes, offset: int) -> Verified:
    return Verified(_record(None, command, offset), decode_command(command, max_inline_bytes=1024))


def test_a_partitions_records_make_one_lane_per_tenant_in_order_erases_alone() -> None:
    items = [
        _verified("acme", publish_command("acme", "a"), 0),
        _verified("beta", publish_command("beta", "b"), 1),
        _verified("acme", publish_command("acme", "a"), 2),
        _verified("acme", erase_command("acme", "a"), 3),
        _verified("acme", publish_command("acme", "c"), 4),
        _verified("acme", publish_command("acme", "d"), 5),
        _verified("acme", publish_command("acme", "e"), 6),
    ]
    lanes = tenant_runs(items, 2)
    offsets = {t: [[i.record.offset for i in run] for run in runs] for t, runs in lanes.items()}
    assert offsets == {"acme": [[0, 2], [3], [4, 5], [6]], "beta": [[1]]}


def test_a_lanes_waiting_runs_are_joined_up_to_the_size_never_across_an_erase() -> None:
    def run(*offsets: int, erase: bool = False) -> list[Verified]:
        make = erase_command if erase else publish_command
        return [_verified("acme", make("acme", "a"), n) for n in offsets]

    queue = collections.deque([run(0, 1), run(2), run(3, 4), run(5, erase=True), run(6)])
    coalesce(queue, 4)
    assert [[i.record.offset for i in r] for r in queue] == [[0, 1, 2], [3, 4], [5], [6]]


async def test_a_tenants_slots_go_once_none_of_its_commands_holds_or_waits() -> None:
    # One semaphore per tenant ever seen would grow with the tenants; a tenant's slots are
    # kept only while a command of its holds or waits for one.
    signers = [Signer(f"t{n}") for n in range(5)]
    applier, dead = Applier(), DeadLetters()
    processor, _ = _processor(applier, dead, *signers, cap=1)
    applier.gates["t0"] = asyncio.Event()
    held = [
        asyncio.create_task(processor.handle(_record(signers[0], publish_command("t0", f"p{n}"))))
        for n in range(2)
    ]
    await applier.reached(1)  # t0's one slot held, its second command waiting
    for signer in signers[1:]:
        await processor.handle(_record(signer, publish_command(signer.tenant_id, "p")))
    assert processor.tenants_in_flight() == {"t0"}
    applier.gates["t0"].set()
    await asyncio.gather(*held)
    assert processor.tenants_in_flight() == set()
    assert applier.most_at_once["t0"] == 1
