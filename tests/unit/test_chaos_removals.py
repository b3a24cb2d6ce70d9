"""The chaos checks of deletes and erases (kbtools/chaos/checks/removals.py) on hand-made evidence:
each reports a violation when the evidence holds one (a deleted document answered, a marker
left in a dump or a Kafka record, a switch after a delete), and nothing when it does not."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kbtools.chaos.checks.checker import Checker
from kbtools.chaos.checks.removals import (
    Gone,
    MarkerScan,
    check_dump,
    check_kafka,
    check_removed_answers,
    check_switch_after_delete,
    gone_documents,
    scan_dump,
)
from kbtools.chaos.checks.result import DELETE_FINAL, DELETED_UNANSWERED, ERASED_GONE, CheckResult
from kbtools.chaos.rig.topology import ChaosStack
from kbtools.chaos.traffic.load import (
    LoadRecord,
    Published,
    Removal,
    RemovalKind,
    lsn_of,
    new_marker,
    render,
    text_of,
)
from kbtools.chaos.traffic.searcher import Answer, Hit, SearchRecord
from services.runtime.messaging.events import DOCUMENT_DELETED, DOCUMENT_SEARCH_VERSION_SWITCHED

DOC = "6f1c0e4e-0000-4000-8000-000000000001"
LIVE = "6f1c0e4e-0000-4000-8000-000000000002"
DELETE_LSN = lsn_of("0/5000000")
ANSWERED = 100.0  # monotonic: when the delete's answer came back


def _gone() -> dict[str, Gone]:
    removal = Removal(
        "acme", DOC, RemovalKind.WHILE_TASK_RUNS, False, "0/5000000", DELETE_LSN, ANSWERED
    )
    return gone_documents([removal])


def _answer(
    *documents: str,
    sent_at: float,
    replayed: int | None = None,
    primary: bool = False,
    absent: str | None = None,
) -> Answer:
    hits = tuple(Hit(d, 1, f"chunk-{n}", "text") for n, d in enumerate(documents))
    return Answer(
        "acme", "acme", ("group:red",), 200, hits, 1, None, sent_at, replayed, primary, absent
    )


def _checked(*answers: Answer) -> CheckResult:
    result = CheckResult()
    check_removed_answers(answers, _gone(), result)
    return result


def test_a_deleted_document_answered_where_it_must_not_be_is_reported() -> None:
    result = _checked(
        # passing the delete's token: whichever server answered
        _answer(DOC, sent_at=ANSWERED + 1, absent=DOC),
        # the primary-only API, after the delete's answer
        _answer(DOC, sent_at=ANSWERED + 1, primary=True),
        # no token, but the replica had replayed the delete before the search was sent
        _answer(DOC, LIVE, sent_at=ANSWERED + 1, replayed=DELETE_LSN),
    )
    assert result.violations[DELETED_UNANSWERED] == 3
    evidence = " / ".join(result.evidence[DELETED_UNANSWERED])
    assert "passing its token" in evidence
    assert "by the primary" in evidence
    assert "after the replica had replayed its delete" in evidence


def test_what_a_replica_without_a_token_may_still_answer_is_counted_not_judged() -> None:
    result = _checked(
        _answer(DOC, sent_at=ANSWERED + 1, replayed=DELETE_LSN - 1),  # replica behind
        _answer(DOC, sent_at=ANSWERED + 1, replayed=None),  # its position never read
        _answer(DOC, sent_at=ANSWERED - 1, primary=True),  # sent before the answer came
        _answer(LIVE, sent_at=ANSWERED + 1, absent=DOC),  # the token's search: not held
    )
    assert result.total == 0, result.evidence
    assert result.figures["hits of deleted documents, replica not yet past the delete"] == 2
    assert result.figures["hits of deleted documents, sent before the delete answer"] == 1
    assert result.figures["searches after a delete, judged"] == 3
    assert result.figures["searches passing a delete token"] == 1
    assert result.figures["searches after a delete with the replica position read"] == 1


def test_the_first_delete_counts_and_a_later_erase_marks_it_erased() -> None:
    delete = Removal("acme", DOC, RemovalKind.LONG_AFTER_PUBLISH, False, "0/10", 16, 5.0)
    erase = Removal("acme", DOC, RemovalKind.ERASE_OF_DELETED, True, "0/20", 32, 9.0)
    gone = gone_documents([erase, delete])[DOC]
    assert (gone.since, gone.lsn, gone.erased) == (5.0, 16, True)


def _dump(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "dump.sql"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_marker_left_in_a_dumped_table_is_reported_with_its_table(tmp_path: Path) -> None:
    erased, kept = new_marker(random.Random(1)), new_marker(random.Random(2))
    clean = _dump(
        tmp_path,
        "SET statement_timeout = 0;",
        "COPY public.knowledge_chunk (chunk_id, text) FROM stdin;",
        f"c1\tReference {kept}. harbour",
        "\\.",
        "COPY public.document_version (content) FROM stdin;",
        f"\\\\x{f'Reference {kept}.'.encode().hex()}",
        "\\.",
    )
    result = CheckResult()
    check_dump(scan_dump(clean), {erased: "acme/doc v1"}, {kept}, result)
    assert result.total == 0, result.evidence

    planted = _dump(
        tmp_path,
        "COPY public.knowledge_chunk (chunk_id, text) FROM stdin;",
        f"c1\tReference {kept}.",
        "\\.",
        "COPY public.index_task (task_id, error_message) FROM stdin;",
        f"t1\tcannot read {erased}",
        "\\.",
        "COPY public.document_version (content) FROM stdin;",
        f"\\\\x00ff{(kept + erased).encode().hex()}",
        "\\.",
    )
    result = CheckResult()
    check_dump(scan_dump(planted), {erased: "acme/doc v1"}, {kept}, result)
    assert result.violations[ERASED_GONE] == 2, result.evidence
    assert (
        f"acme/doc v1: its marker {erased} is in the pg_dump as text (public.index_task)"
        in (result.evidence[ERASED_GONE])
    )
    assert any(
        "as bytes (public.document_version)" in line for line in result.evidence[ERASED_GONE]
    )


def test_a_dump_scan_that_sees_no_kept_marker_is_blind() -> None:
    result = CheckResult()
    check_dump(MarkerScan(text={"kbm0000000000000001": "t"}), {}, {"kbm0000000000000001"}, result)
    assert result.violations[ERASED_GONE] == 1
    assert "blind" in result.evidence[ERASED_GONE][0]


@dataclass(frozen=True)
class _Record:
    topic: str
    key: str
    event_type: str
    position: int
    payload: bytes


def test_a_marker_in_a_kafka_record_is_reported() -> None:
    marker = new_marker(random.Random(3))
    records = [
        _Record("t", f"acme/{LIVE}", "DocumentVersionPublished", 1, b"\x02Record 1"),
        _Record("t", f"acme/{DOC}", "DocumentVersionPublished", 2, b"x" + marker.encode()),
    ]
    result = CheckResult()
    check_kafka(records, {marker: f"acme/{DOC} v1"}, result)
    assert result.violations[ERASED_GONE] == 1
    assert "DocumentVersionPublished record of t" in result.evidence[ERASED_GONE][0]
    result = CheckResult()
    check_kafka(records[:1], {marker: f"acme/{DOC} v1"}, result)
    assert result.total == 0


def test_a_switch_committed_after_the_delete_is_reported() -> None:
    key = f"acme/{DOC}"
    before = _Record("d", key, DOCUMENT_SEARCH_VERSION_SWITCHED, 5, b"")
    deleted = _Record("d", key, DOCUMENT_DELETED, 7, b"")
    result = CheckResult()
    check_switch_after_delete([before, deleted], result)
    assert result.total == 0
    after = _Record("d", key, DOCUMENT_SEARCH_VERSION_SWITCHED, 9, b"")
    check_switch_after_delete([before, deleted, after], result)
    assert result.violations[DELETE_FINAL] == 1
    assert "switched at outbox position 9 after its delete at 7" in result.evidence[DELETE_FINAL][0]


def test_each_format_keeps_the_marker_whole_in_its_bytes() -> None:
    marker = new_marker(random.Random(4))
    paragraphs = text_of(random.Random(5), 1, 1, marker)
    assert paragraphs[0] == f"Reference {marker}."
    for kind in ("md", "txt", "html", "pdf"):
        assert marker.encode() in render(kind, "Record 1", paragraphs), kind
    assert marker.encode() not in render("corrupt-pdf", "Record 1", paragraphs)


def test_an_erased_versions_readers_come_from_the_load_record(tmp_path: Path) -> None:
    # An erase removes the versions' ACL rows; the answers given before it are judged by
    # the readers the driver published each version with.
    load = LoadRecord(
        published=[
            Published("acme", DOC, 1, ["group:red"], "md"),
            Published("acme", LIVE, 1, ["group:blue"], "md"),
        ],
        removed=[Removal("acme", DOC, RemovalKind.LONG_AFTER_PUBLISH, True, "0/10", 16, 5.0)],
    )
    checker = Checker(ChaosStack(tmp_path, pg_port=1, kafka_port=2), SearchRecord(), load)
    assert checker._readers() == {(DOC, 1): {"group:red"}}
