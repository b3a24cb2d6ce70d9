"""Which states of a document are drift, and what `kb index check --repair` does about each."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from services.indexer.maintenance.index_check import (
    DocumentIndexState,
    DriftKind,
    RepairAction,
    find_drift,
)
from services.runtime.tasks import TaskStatus

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
