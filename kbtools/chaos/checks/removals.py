"""Deletes and erases in a chaos run: what the load driver did (each answer's `searchToken`
and when it came), and the checks of what must follow (docs/architecture.md#document-lifecycle).

- *Never answered after its delete.* A search sent after the delete's answer came back must
  not hold the document when it passed the delete's token (or the token of a status that said
  `DELETED`), whichever server answered; when it went to the primary-only API; and, without
  a token, when the replica's replay position, read before the search was sent, had passed
  the delete's token. Without a token a search may still meet a replica that has not
  replayed the delete: such hits are counted, not judged (what a replica promises without a
  token is only that it catches up). A search sent before the answer came is not judged: the
  commit's moment is only known to lie before the answer.
- *Final.* A deleted document is deleted, served by a tombstone; no switch of it is committed
  after its `DocumentDeleted`; a task ended `DOCUMENT_DELETED` belongs to a deleted document.
- *Erased: nothing left.* No marker of an erased document's content is in a `pg_dump` of
  the run's database (as text, or as the hex a `bytea` is dumped as) nor in any Kafka
  record; its chunks and bytes are gone and its audit row says erased. Markers of documents
  not erased must be found in the dump, as text and as bytes: else the scan is blind.
"""

from __future__ import annotations

import mmap
import re
import subprocess
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import asyncpg

from kbtools.chaos.checks.queries import QUERIES
from kbtools.chaos.checks.result import DELETE_FINAL, DELETED_UNANSWERED, ERASED_GONE, CheckResult
from kbtools.chaos.traffic.load import Removal
from kbtools.chaos.traffic.searcher import Answer
from services.runtime.messaging.events import DOCUMENT_DELETED, DOCUMENT_SEARCH_VERSION_SWITCHED

MARKER = re.compile(rb"kbm[0-9a-f]{16}")
# The same, as PostgreSQL dumps a bytea (lowercase hex of each byte: "kbm" is 6b 62 6d).
MARKER_HEX = re.compile(rb"6b626d(?:3[0-9]|6[1-6]){16}")
_COPY = re.compile(rb"^COPY ([^ ]+) ", re.MULTILINE)


@dataclass(frozen=True)
class Gone:
    """A document as its first delete (or erase) left it."""

    tenant_id: str
    document_id: str
    since: float  # monotonic: when the first answer came back
    lsn: int  # that answer's token
    erased: bool


def gone_documents(removals: Iterable[Removal]) -> dict[str, Gone]:
    gone: dict[str, Gone] = {}
    for r in sorted(removals, key=lambda r: r.answered_at):
        first = gone.get(r.document_id)
        if first is None:
            gone[r.document_id] = Gone(r.tenant_id, r.document_id, r.answered_at, r.lsn, r.erased)
        elif r.erased:
            gone[r.document_id] = Gone(
                first.tenant_id, first.document_id, first.since, first.lsn, True
            )
    return gone


def removal_figures(removals: list[Removal], result: CheckResult) -> None:
    kinds = Counter((r.kind, r.erased) for r in removals)
    result.figures["removals"] = {
        f"{'erases' if erased else 'deletes'} {kind.value}": n
        for (kind, erased), n in sorted(kinds.items())
    }
    result.figures["deletes"] = sum(not r.erased for r in removals)
    result.figures["erases"] = sum(r.erased for r in removals)


def check_removed_answers(
    answers: Iterable[Answer], gone: Mapping[str, Gone], result: CheckResult
) -> None:
    """Each answer against each document deleted before it was sent (module docstring)."""
    first = min((g.since for g in gone.values()), default=None)
    judged = tokened = primary = positioned = lagging = before = 0
    for answer in answers:
        if answer.status != 200 or answer.tenant_id != answer.path_tenant:
            continue
        if first is not None and answer.sent_at > first:
            judged += 1
            primary += answer.primary
            positioned += not answer.primary and answer.replayed is not None
        tokened += answer.absent is not None
        for document_id in sorted({h.document_id for h in answer.hits}):
            g = gone.get(document_id)
            if g is None:
                continue
            where = f"{answer.path_tenant}/{document_id} ({'erased' if g.erased else 'deleted'})"
            if answer.absent == document_id:
                result.violate(
                    DELETED_UNANSWERED, f"{where}: answered to a search passing its token"
                )
            elif answer.sent_at <= g.since:
                before += 1
            elif answer.primary:
                result.violate(
                    DELETED_UNANSWERED, f"{where}: answered by the primary after its delete"
                )
            elif answer.replayed is not None and answer.replayed >= g.lsn:
                result.violate(
                    DELETED_UNANSWERED,
                    f"{where}: answered without a token after the replica had replayed its delete",
                )
            else:
                lagging += 1
    figures = result.figures
    figures["searches after a delete, judged"] = judged
    figures["searches passing a delete token"] = tokened
    figures["searches of the primary-only API after a delete"] = primary
    figures["searches after a delete with the replica position read"] = positioned
    figures["hits of deleted documents, replica not yet past the delete"] = lagging
    figures["hits of deleted documents, sent before the delete answer"] = before


# --- what an erase leaves -----------------------------------------------------------------


@dataclass
class MarkerScan:
    """The markers a text holds, each with where it was (a table of a dump, a topic)."""

    text: dict[str, str] = field(default_factory=dict)
    hexed: dict[str, str] = field(default_factory=dict)  # as a dumped bytea


def scan_dump(path: Path) -> MarkerScan:
    """The markers of a plain `pg_dump` file, each with the table whose COPY held it."""
    scan = MarkerScan()
    if path.stat().st_size == 0:
        return scan
    with path.open("rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
        headers = [(m.start(), m.group(1).decode(errors="replace")) for m in _COPY.finditer(data)]
        starts = [start for start, _ in headers]

        def table(position: int) -> str:
            i = bisect_right(starts, position) - 1
            return headers[i][1] if i >= 0 else "(before any table's data)"

        for m in MARKER.finditer(data):
            scan.text.setdefault(m.group().decode(), table(m.start()))
        for m in MARKER_HEX.finditer(data):
            scan.hexed.setdefault(bytes.fromhex(m.group().decode()).decode(), table(m.start()))
    return scan


def pg_dump(pg_dump_bin: Path, database_url: str, out: Path) -> None:
    """The whole database in plain SQL, as an operator would take it."""
    subprocess.run(
        [str(pg_dump_bin), "--dbname", database_url, "--no-owner", "--file", str(out)],
        capture_output=True,
        check=True,
        timeout=1800,
    )


def check_dump(
    scan: MarkerScan, erased: Mapping[str, str], kept: Iterable[str], result: CheckResult
) -> None:
    """``erased``: marker -> the version it was in; ``kept``: markers of versions not erased."""
    for marker, version in sorted(erased.items()):
        for form, found in (("text", scan.text), ("bytes", scan.hexed)):
            if marker in found:
                result.violate(
                    ERASED_GONE,
                    f"{version}: its marker {marker} is in the pg_dump as {form} ({found[marker]})",
                )
    kept = set(kept)
    seen_text, seen_bytes = len(kept & set(scan.text)), len(kept & set(scan.hexed))
    if kept and not (seen_text and seen_bytes):
        result.violate(
            ERASED_GONE,
            f"the dump scan is blind: of {len(kept)} markers of versions not erased, "
            f"{seen_text} found as text, {seen_bytes} as bytes",
        )
    result.figures["erased markers looked for in the pg_dump"] = len(erased)
    result.figures["kept markers found in the pg_dump (text / bytes)"] = (
        f"{seen_text} / {seen_bytes} of {len(kept)}"
    )


class _Record(Protocol):
    """A Kafka record as the checker read it (checker.KafkaRecord)."""

    @property
    def topic(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def event_type(self) -> str: ...
    @property
    def position(self) -> int: ...
    @property
    def payload(self) -> bytes: ...


def check_kafka(records: Iterable[_Record], erased: Mapping[str, str], result: CheckResult) -> None:
    """No Kafka record carries a marker of an erased document's content."""
    scanned = 0
    for record in records:
        scanned += 1
        for m in MARKER.finditer(record.payload):
            marker = m.group().decode()
            if marker in erased:
                result.violate(
                    ERASED_GONE,
                    f"{erased[marker]}: its marker is in a {record.event_type} record of "
                    f"{record.topic} (key {record.key})",
                )
    result.figures["Kafka records scanned for erased markers"] = scanned


# --- final --------------------------------------------------------------------------------


async def check_final(
    conn: asyncpg.Connection[Any],
    gone: Mapping[str, Gone],
    unanswered: set[str],
    records: Iterable[_Record],
    result: CheckResult,
) -> None:
    """What the database and Kafka hold of the deleted and erased documents. ``unanswered``:
    documents whose delete or erase the driver never had an answer to (it may have
    committed)."""
    for row in await conn.fetch(QUERIES["removal_states"]):
        document_id = row["document_id"]
        where = f"{row['tenant_id']}/{document_id}"
        g = gone.get(document_id)
        if g is None:
            if (row["deleted"] or row["tombstone"]) and document_id not in unanswered:
                result.violate(DELETE_FINAL, f"{where}: deleted, yet the run never deleted it")
            continue
        if not (row["deleted"] and row["tombstone"]):
            result.violate(
                DELETE_FINAL,
                f"{where}: deleted {row['deleted']}, its pointer a tombstone {row['tombstone']}",
            )
        if g.erased and not (row["erased"] and row["chunks"] == 0 and row["with_bytes"] == 0):
            result.violate(
                ERASED_GONE,
                f"{where}: erase finished {row['erased']} (asked {row['erasing']}), "
                f"{row['chunks']} chunks, {row['with_bytes']} versions with bytes left",
            )
    for row in await conn.fetch(QUERIES["cancelled_live_documents"]):
        result.violate(
            DELETE_FINAL,
            f"{row['tenant_id']}/{row['document_id']}: not deleted, yet {row['tasks']} of its "
            "tasks ended DOCUMENT_DELETED",
        )
    check_switch_after_delete(records, result)


def check_switch_after_delete(records: Iterable[_Record], result: CheckResult) -> None:
    """No switch of a document committed after its delete: every switch event's outbox
    position (the order of the commits that wrote them, the delete waiting for a completion
    that holds the pointer) is below the document's DocumentDeleted."""
    deleted: dict[str, int] = {}
    switches: dict[str, list[int]] = {}
    for record in records:
        if record.event_type == DOCUMENT_DELETED:
            deleted[record.key] = min(record.position, deleted.get(record.key, record.position))
        elif record.event_type == DOCUMENT_SEARCH_VERSION_SWITCHED:
            switches.setdefault(record.key, []).append(record.position)
    for key, at in sorted(deleted.items()):
        later = sorted(p for p in switches.get(key, []) if p > at)
        if later:
            result.violate(
                DELETE_FINAL,
                f"{key}: switched at outbox position {later[0]} after its delete at {at}",
            )
    result.figures["DocumentDeleted events in Kafka"] = len(deleted)
