"""The chaos run's ingest check on hand-made records: every command sent applied exactly
once passes; a command lost, recorded twice, or applied twice (a version no record names)
is reported."""

from __future__ import annotations

from typing import Any

from kbtools.chaos.checks.commands import check_commands
from kbtools.chaos.checks.result import INGEST_ONCE, CheckResult
from kbtools.chaos.traffic.ingest import SentCommand
from services.publisher.ingest.commands import PUBLISH_DOCUMENT

DOC = "6f1c0e4e-0000-4000-8000-000000000001"
SENT = [SentCommand("acme", "c1", "record-1"), SentCommand("acme", "c2", "record-1")]


def _row(command_id: str, version: int | None) -> dict[str, Any]:
    return {
        "tenant_id": "acme",
        "command_id": command_id,
        "command_type": PUBLISH_DOCUMENT,
        "document_id": DOC,
        "version_number": version,
    }


def _version(number: int) -> dict[str, Any]:
    return {"tenant_id": "acme", "document_id": DOC, "version_number": number}


def _checked(rows: list[dict[str, Any]], versions: list[dict[str, Any]]) -> CheckResult:
    result = CheckResult()
    check_commands(SENT, rows, versions, result)
    return result


def test_each_command_applied_once_passes() -> None:
    result = _checked([_row("c1", 1), _row("c2", 2)], [_version(1), _version(2)])
    assert result.total == 0, result.evidence
    assert result.figures["ingest commands sent"] == 2
    assert result.figures["ingest commands applied"] == 2


def test_a_lost_command_is_reported() -> None:
    result = _checked([_row("c1", 1)], [_version(1)])
    assert result.violations[INGEST_ONCE] == 1
    assert "c2" in result.evidence[INGEST_ONCE][0]
    assert "never applied" in result.evidence[INGEST_ONCE][0]
    assert result.figures["ingest commands applied"] == 1


def test_a_command_recorded_twice_is_reported() -> None:
    result = _checked([_row("c1", 1), _row("c1", 1), _row("c2", 2)], [_version(1), _version(2)])
    assert result.violations[INGEST_ONCE] >= 1
    assert any("recorded 2 times" in e for e in result.evidence[INGEST_ONCE])


def test_a_command_applied_twice_leaves_a_version_no_record_names() -> None:
    # c2 applied a second time without its record: v3 is nobody's.
    result = _checked([_row("c1", 1), _row("c2", 2)], [_version(1), _version(2), _version(3)])
    assert result.violations[INGEST_ONCE] == 1
    assert "v3 made by 0 commands" in result.evidence[INGEST_ONCE][0]


def test_a_publish_recorded_without_its_version_is_reported() -> None:
    result = _checked([_row("c1", 1), _row("c2", None)], [_version(1)])
    assert result.violations[INGEST_ONCE] == 1
    assert "without a version" in result.evidence[INGEST_ONCE][0]
