"""The chaos run's pure parts: the seeded schedule and the pointer audit over Kafka."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

from kbtools.chaos.checks.checker import Checker, KafkaRecord
from kbtools.chaos.rig.schedule import INGESTERS, FaultKind, plan
from kbtools.chaos.rig.topology import ChaosStack
from kbtools.chaos.traffic.load import minimal_pdf
from kbtools.chaos.traffic.searcher import SearchRecord
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import DOCUMENT_SEARCH_VERSION_SWITCHED


def test_a_seed_replays_its_schedule_and_plans_every_kind() -> None:
    first = plan(7, fault_window_s=100, faults=30)
    assert first == plan(7, fault_window_s=100, faults=30)
    assert first != plan(8, fault_window_s=100, faults=30)
    assert {f.kind for f in first} == set(FaultKind)
    # The ingest consumers' kills come on top of the budget, from a generator of their own.
    ingest = [f for f in first if f.kind is FaultKind.KILL_INGEST]
    assert len(first) - len(ingest) == 30
    assert {f.target for f in ingest} == set(INGESTERS)
    assert all(2 <= f.at_s <= 100 for f in first)
    assert [f.at_s for f in first] == sorted(f.at_s for f in first)
    assert sum(f.kind is FaultKind.POSTGRES_RESTART for f in first) == 1


def _switched(document: uuid.UUID, version: int) -> KafkaRecord:
    event_id = str(uuid.uuid4())
    record = {
        "eventId": event_id,
        "tenantId": "acme",
        "tier": "standard",
        "documentId": str(document),
        "versionNumber": version,
        "previousVersionNumber": None,
        "embeddingModel": "hashing-v1-384",
        "chunkCount": 1,
        "taskId": str(uuid.uuid4()),
        "occurredAt": datetime.now(UTC),
    }
    payload = default_registry().encode(DOCUMENT_SEARCH_VERSION_SWITCHED, record)
    key = f"acme/{document}"
    event_type = DOCUMENT_SEARCH_VERSION_SWITCHED
    return KafkaRecord("t", key, event_id, event_type, version, False, payload)


def test_the_audit_names_a_pointer_that_moved_back(tmp_path: Path) -> None:
    stack = ChaosStack(tmp_path, pg_port=1, kafka_port=2)
    document, other = uuid.uuid4(), uuid.uuid4()
    checker = Checker(stack, SearchRecord())
    checker._pointer_forward([_switched(document, 1), _switched(other, 3), _switched(document, 2)])
    assert checker.result.total == 0

    checker = Checker(stack, SearchRecord())
    checker._pointer_forward([_switched(document, 2), _switched(document, 1)])
    assert checker.result.violations["pointer only moves forward"] == 1
    assert "from v2 to v1" in checker.result.evidence["pointer only moves forward"][0]


def test_the_load_pdf_is_a_pdf_with_its_text() -> None:
    pdf = minimal_pdf(["Record 1 (part one)", "harbour ledger"])
    assert pdf.startswith(b"%PDF-1.4")
    assert pdf.rstrip().endswith(b"%%EOF")
    assert b"(Record 1 \\(part one\\)) '" in pdf
