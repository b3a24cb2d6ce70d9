"""Which states of a document are drift, and what `kb index check --repair` does about each."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from services.indexer.maintenance.index_check import (
    DocumentIndexState,
    Drift,
    DriftKey,
    DriftKind,
    RepairAction,
    Verdict,
    appeared,
    drift_key,
    find_drift,
    find_leftover_drift,
    verify,
)
from services.runtime.erasure.leftovers import Leftovers
from services.runtime.indexing.tasks import TaskStatus

TASK_V1 = uuid.UUID(int=1)
TASK_V2 = uuid.UUID(int=2)

SERVED_V1 = DocumentIndexState(
    tenant_id="acme",
    tier="standard",
    document_id=uuid.UUID(int=7),
    published_version=1,
    served_version=1,
    recorded_chunks=12,
    present_chunks=12,
    published_task_id=TASK_V1,
    published_task_status=TaskStatus.SUCCEEDED,
    served_task_id=TASK_V1,
    served_task_status=TaskStatus.SUCCEEDED,
)
V2_PUBLISHED = replace(SERVED_V1, published_version=2, published_task_id=TASK_V2)


def kinds(state: DocumentIndexState) -> list[tuple[DriftKind, RepairAction, uuid.UUID | None]]:
    return [(d.kind, d.repair.action, d.repair.task_id) for d in find_drift(state)]


@pytest.mark.parametrize(
    "state",
    [
        SERVED_V1,
        # Being indexed: its task will run.
        *(
            replace(V2_PUBLISHED, published_task_status=s)
            for s in (TaskStatus.PENDING, TaskStatus.RUNNING, TaskStatus.RETRY_WAIT)
        ),
        # FAILED: shown on the document, requeued by an operator if at all.
        replace(V2_PUBLISHED, published_task_status=TaskStatus.DEAD),
        # Published, never indexed yet, task queued.
        replace(
            SERVED_V1,
            served_version=None,
            recorded_chunks=None,
            present_chunks=None,
            published_task_status=TaskStatus.PENDING,
            served_task_id=None,
            served_task_status=None,
        ),
    ],
)
def test_healthy_or_visibly_failed_documents_are_not_drift(state: DocumentIndexState) -> None:
    assert find_drift(state) == []


def test_a_published_version_without_a_task_gets_one() -> None:
    state = replace(V2_PUBLISHED, published_task_id=None, published_task_status=None)
    [drift] = find_drift(state)
    assert (drift.kind, drift.repair.action, drift.repair.version_number) == (
        DriftKind.NOT_QUEUED,
        RepairAction.ENQUEUE,
        2,
    )


def test_a_succeeded_version_that_is_not_served_runs_again() -> None:
    state = replace(V2_PUBLISHED, published_task_status=TaskStatus.SUCCEEDED)
    assert kinds(state) == [(DriftKind.SUCCEEDED_NOT_SERVED, RepairAction.RERUN, TASK_V2)]
    lost_pointer = replace(
        SERVED_V1, served_version=None, recorded_chunks=None, present_chunks=None
    )
    assert kinds(lost_pointer) == [(DriftKind.SUCCEEDED_NOT_SERVED, RepairAction.RERUN, TASK_V1)]


@pytest.mark.parametrize("present", [0, 11, 13])
def test_a_served_version_with_other_chunks_than_recorded_is_indexed_again(present: int) -> None:
    state = replace(SERVED_V1, present_chunks=present)
    [drift] = find_drift(state)
    assert (drift.kind, drift.repair.action, drift.repair.task_id) == (
        DriftKind.CHUNKS_MISSING,
        RepairAction.RERUN,
        TASK_V1,
    )
    assert f"has {present} chunks, the switch wrote 12" in drift.detail


def test_a_damaged_served_version_without_its_task_gets_one() -> None:
    state = replace(SERVED_V1, present_chunks=3, served_task_id=None, served_task_status=None)
    [drift] = find_drift(state)
    assert (drift.repair.action, drift.repair.version_number) == (RepairAction.ENQUEUE, 1)


def test_two_drifts_of_one_document_are_both_named() -> None:
    state = replace(
        V2_PUBLISHED, present_chunks=0, published_task_id=None, published_task_status=None
    )
    assert [d.kind for d in find_drift(state)] == [DriftKind.CHUNKS_MISSING, DriftKind.NOT_QUEUED]


@pytest.mark.parametrize("published", [None, 1])
def test_a_pointer_ahead_is_left_to_an_operator(published: int | None) -> None:
    state = replace(SERVED_V1, served_version=2, published_version=published)
    [drift] = find_drift(state)
    assert (drift.kind, drift.repair.action) == (DriftKind.POINTER_AHEAD, RepairAction.NONE)


def test_a_damaged_version_whose_task_runs_again_anyway_needs_nothing() -> None:
    state = replace(SERVED_V1, present_chunks=5, served_task_status=TaskStatus.RUNNING)
    [drift] = find_drift(state)
    assert (drift.kind, drift.repair.action) == (DriftKind.CHUNKS_MISSING, RepairAction.NONE)
    assert "RUNNING" in drift.repair.reason


# --- chunked by older code ------------------------------------------------------------------

OLD_CODE = {"chunker": "1", "pypdf": "5.4.0", "tokenizers": "0.21.1"}
NEW_CODE = {"chunker": "1", "pypdf": "6.0.0", "tokenizers": "0.21.1"}
OLDER = replace(
    SERVED_V1,
    served_strategy="heading-semchunk-v1:max=128:overlap=0:tok=t:code=aaaaaaaaaaaa",
    current_strategy="heading-semchunk-v1:max=128:overlap=0:tok=t:code=bbbbbbbbbbbb",
    served_code=OLD_CODE,
    current_code=NEW_CODE,
)


def test_a_served_version_chunked_by_older_code_is_chunked_again() -> None:
    [drift] = find_drift(OLDER)
    assert (drift.kind, drift.repair.action, drift.repair.version_number) == (
        DriftKind.OLDER_CHUNKING,
        RepairAction.RERUN,
        1,
    )
    assert drift.detail == "served v1 chunked by older code (pypdf 5.4.0 -> 6.0.0)"
    assert find_drift(replace(OLDER, current_strategy=OLDER.served_strategy)) == []


def test_a_version_chunked_before_the_code_was_recorded_is_chunked_by_older_code() -> None:
    state = replace(
        OLDER,
        served_strategy="heading-semchunk-v1:max=128:overlap=0:tok=t",
        served_code=None,
    )
    [drift] = find_drift(state)
    assert drift.kind is DriftKind.OLDER_CHUNKING
    assert drift.detail == "served v1 chunked by older code (its code's versions were not recorded)"


def test_other_chunk_settings_are_another_generation_not_drift() -> None:
    # Settings apply to new versions; served ones keep their strategy.
    other_settings = "heading-semchunk-v1:max=256:overlap=0:tok=t:code=bbbbbbbbbbbb"
    assert find_drift(replace(OLDER, current_strategy=other_settings)) == []


@pytest.mark.parametrize(
    "state",
    [
        # A newer version is on its way (its task runs, or its own drift's repair moves the
        # pointer forward): chunking the served one again would be wasted.
        replace(
            OLDER,
            published_version=2,
            published_task_id=TASK_V2,
            published_task_status=TaskStatus.PENDING,
        ),
        replace(
            OLDER,
            published_version=2,
            published_task_id=TASK_V2,
            published_task_status=TaskStatus.SUCCEEDED,
        ),
        # Nothing registered for the served model, or a pointer naming no strategy.
        replace(OLDER, current_strategy=None),
        replace(OLDER, served_strategy=None),
    ],
)
def test_older_chunking_is_not_reported_where_it_would_not_help(
    state: DocumentIndexState,
) -> None:
    assert DriftKind.OLDER_CHUNKING not in [d.kind for d in find_drift(state)]


def test_older_chunking_of_a_version_whose_successor_failed_is_reported() -> None:
    state = replace(
        OLDER, published_version=2, published_task_id=TASK_V2, published_task_status=TaskStatus.DEAD
    )
    assert kinds(state) == [(DriftKind.OLDER_CHUNKING, RepairAction.RERUN, TASK_V1)]


def test_missing_chunks_are_the_one_drift_of_a_damaged_version_chunked_by_older_code() -> None:
    # One re-run repairs both: it chunks with the current code and fills the set.
    assert kinds(replace(OLDER, present_chunks=3)) == [
        (DriftKind.CHUNKS_MISSING, RepairAction.RERUN, TASK_V1)
    ]


# --- verifying a repair -----------------------------------------------------------------------


def one_drift(state: DocumentIndexState) -> Drift:
    [drift] = find_drift(state)
    return drift


DAMAGED = one_drift(replace(SERVED_V1, present_chunks=3))


@pytest.mark.parametrize(
    ("queued", "status", "after", "verdict"),
    [
        (True, TaskStatus.SUCCEEDED, set(), Verdict.REPAIRED),
        (True, TaskStatus.SUCCEEDED, {drift_key(DAMAGED)}, Verdict.STILL_DRIFTING),
        (True, TaskStatus.DEAD, set(), Verdict.TASK_FAILED),
        (True, None, set(), Verdict.TASK_FAILED),
        # Still live when the wait ran out: the check after it cannot tell (a live task is
        # not drift), so it is not counted as repaired.
        (True, TaskStatus.PENDING, set(), Verdict.NOT_FINISHED),
        (True, TaskStatus.RETRY_WAIT, set(), Verdict.NOT_FINISHED),
        (True, TaskStatus.SUCCEEDED, None, Verdict.NOT_VERIFIED),
        (False, None, set(), Verdict.NOT_REPAIRED),
    ],
)
def test_a_drift_is_repaired_only_when_the_check_after_its_task_no_longer_finds_it(
    queued: bool,
    status: TaskStatus | None,
    after: set[DriftKey] | None,
    verdict: Verdict,
) -> None:
    verified = verify(
        DAMAGED, queued=queued, note="task back to PENDING", task_status=status, after=after
    )
    assert verified.verdict is verdict


def test_another_drift_of_the_same_document_does_not_hide_a_repair() -> None:
    other = (DAMAGED.state.tenant_id, DAMAGED.state.document_id, DriftKind.NOT_QUEUED)
    verified = verify(
        DAMAGED, queued=True, note="", task_status=TaskStatus.SUCCEEDED, after={other}
    )
    assert verified.verdict is Verdict.REPAIRED


def test_drifts_that_appear_during_the_repair_are_named() -> None:
    fresh = one_drift(
        replace(
            V2_PUBLISHED,
            document_id=uuid.UUID(int=9),
            published_task_id=None,
            published_task_status=None,
        )
    )
    assert appeared([DAMAGED], [DAMAGED, fresh]) == [fresh]
    assert appeared([DAMAGED, fresh], [fresh]) == []


# --- deleted and erased documents ---------------------------------------------------------

WHEN = datetime(2026, 1, 1, tzinfo=UTC)
DELETED = Leftovers(
    tenant_id="acme",
    document_id=uuid.UUID(int=11),
    deleted_at=WHEN,
    erase_requested_at=None,
    erased_at=None,
    tombstoned=True,
    pointer_version=2,
    chunks=0,
    staged_slices=0,
    served_acl=0,
    version_bytes=0,
    version_acl=0,
    task_messages=0,
    requeue_messages=0,
    outbox_events=0,
    title_kept=False,
)
ERASED = replace(DELETED, erase_requested_at=WHEN, erased_at=WHEN)


def leftover_kinds(left: Leftovers) -> list[tuple[DriftKind, RepairAction]]:
    return [(d.kind, d.repair.action) for d in find_leftover_drift(left)]


@pytest.mark.parametrize("left", [DELETED, ERASED])
def test_a_deleted_or_erased_document_holding_nothing_is_not_drift(left: Leftovers) -> None:
    assert find_leftover_drift(left) == []


@pytest.mark.parametrize(
    ("changes", "kind"),
    [
        ({"tombstoned": False}, DriftKind.DELETED_NOT_TOMBSTONED),
        ({"tombstoned": False, "pointer_version": None}, DriftKind.DELETED_NOT_TOMBSTONED),
        ({"chunks": 3}, DriftKind.DELETED_CHUNKS),
        ({"staged_slices": 2}, DriftKind.DELETED_STAGED_SLICES),
        ({"served_acl": 1}, DriftKind.DELETED_ACL),
    ],
)
def test_each_leftover_of_a_deleted_document_is_drift_removed_in_place(
    changes: dict[str, object], kind: DriftKind
) -> None:
    assert leftover_kinds(replace(DELETED, **changes)) == [(kind, RepairAction.REMOVE)]  # type: ignore[arg-type]
    # Once an erase was asked for, the repair finishes the erase instead.
    assert leftover_kinds(replace(ERASED, **changes)) == [(kind, RepairAction.ERASE)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"erased_at": None},
        {"version_bytes": 1},
        {"version_acl": 1},
        {"task_messages": 1},
        {"requeue_messages": 1},
        {"outbox_events": 1},
        {"title_kept": True},
    ],
)
def test_what_the_erase_removes_is_drift_only_once_an_erase_was_asked_for(
    changes: dict[str, object],
) -> None:
    erased = replace(ERASED, **changes)  # type: ignore[arg-type]
    assert leftover_kinds(erased) == [(DriftKind.ERASE_UNFINISHED, RepairAction.ERASE)]
    if "erased_at" not in changes:
        assert find_leftover_drift(replace(DELETED, **changes)) == []  # type: ignore[arg-type]


def test_leftovers_are_named_by_count_never_content() -> None:
    [drift] = find_leftover_drift(replace(ERASED, erased_at=None, version_bytes=2, title_kept=True))
    assert drift.detail == "erase asked for, erased_at unset; left: version bytes 2, title 1"


def test_a_removal_is_repaired_when_the_check_after_it_no_longer_finds_it() -> None:
    [drift] = find_leftover_drift(replace(DELETED, chunks=4))
    removed = {"queued": True, "note": "removed", "task_status": None}
    assert verify(drift, **removed, after=set()).verdict is Verdict.REPAIRED  # type: ignore[arg-type]
    assert (
        verify(drift, **removed, after={drift_key(drift)}).verdict  # type: ignore[arg-type]
        is Verdict.STILL_DRIFTING
    )
