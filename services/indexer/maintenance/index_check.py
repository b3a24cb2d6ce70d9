"""`kb index check`: find documents whose search state drifted from what was published, and
decide how each drift is repaired (docs/architecture.md#invariants).

The pipeline keeps the index right by construction (one fenced transaction moves chunks,
pointer, task and event together); drift is what a restore from backup, a hand-edited row
or a bug leaves behind, and what no worker will fix by itself. Not drift: a version being
indexed (its task is live) and a FAILED one (its task is DEAD, shown on the document and
the operator page; `kb tasks requeue` is the operator's answer).

Pure domain code: the adapter (``index_check_pg``) reads one row per document and carries out
the repairs this module decides.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass

from services.runtime.tasks import TaskStatus


class DriftKind(enum.StrEnum):
    # Published, not served, and no task exists that would index it.
    NOT_QUEUED = "NOT_QUEUED"
    # The published version's task SUCCEEDED, yet the pointer is behind it.
    SUCCEEDED_NOT_SERVED = "SUCCEEDED_NOT_SERVED"
    # The served version has fewer (or more) chunks than the switch recorded: search
    # answers from a part of the document.
    CHUNKS_MISSING = "CHUNKS_MISSING"
    # The pointer names a version newer than the published one (or the document was never
    # published): no task can move a pointer back, an operator must look.
    POINTER_AHEAD = "POINTER_AHEAD"


class RepairAction(enum.StrEnum):
    ENQUEUE = "ENQUEUE"  # create the missing task of the version
    RERUN = "RERUN"  # put the version's SUCCEEDED task back to PENDING
    NONE = "NONE"  # nothing to do by machine (see the reason)


@dataclass(frozen=True)
class DocumentIndexState:
    """What the check reads of one document, in one snapshot."""

    tenant_id: str
    tier: str
    document_id: uuid.UUID
    published_version: int | None
    served_version: int | None
    recorded_chunks: int | None  # what the switch wrote on the pointer
    present_chunks: int | None  # chunks of the pointer's version, model and strategy
    published_task_id: uuid.UUID | None
    published_task_status: TaskStatus | None
    served_task_id: uuid.UUID | None
    served_task_status: TaskStatus | None


@dataclass(frozen=True)
class Repair:
    action: RepairAction
    version_number: int | None
    task_id: uuid.UUID | None
    reason: str


@dataclass(frozen=True)
class Drift:
    kind: DriftKind
    state: DocumentIndexState
    detail: str
    repair: Repair


_LIVE = frozenset({TaskStatus.PENDING, TaskStatus.RUNNING, TaskStatus.RETRY_WAIT})


def find_drift(state: DocumentIndexState) -> list[Drift]:
    """Every drift of one document (a document can have two: a damaged served version and
    a newer published version nobody will index)."""
    found: list[Drift] = []
    published, served = state.published_version, state.served_version
    if served is not None and (published is None or served > published):
        found.append(
            Drift(
                DriftKind.POINTER_AHEAD,
                state,
                f"served v{served} but published {_version(published)}",
                Repair(
                    RepairAction.NONE, None, None, "a pointer never moves back: needs an operator"
                ),
            )
        )
    elif served is not None and state.present_chunks != state.recorded_chunks:
        found.append(
            Drift(
                DriftKind.CHUNKS_MISSING,
                state,
                f"served v{served} has {state.present_chunks} chunks, "
                f"the switch wrote {state.recorded_chunks}",
                _rerun(served, state.served_task_id, state.served_task_status),
            )
        )
    if published is not None and (served is None or served < published):
        if state.published_task_id is None:
            found.append(
                Drift(
                    DriftKind.NOT_QUEUED,
                    state,
                    f"published v{published}, served {_version(served)}, no index task",
                    Repair(RepairAction.ENQUEUE, published, None, "create the task"),
                )
            )
        elif state.published_task_status is TaskStatus.SUCCEEDED:
            found.append(
                Drift(
                    DriftKind.SUCCEEDED_NOT_SERVED,
                    state,
                    f"published v{published} SUCCEEDED, served {_version(served)}",
                    _rerun(published, state.published_task_id, state.published_task_status),
                )
            )
    return found


def _rerun(version: int, task_id: uuid.UUID | None, status: TaskStatus | None) -> Repair:
    if task_id is None:
        return Repair(RepairAction.ENQUEUE, version, None, "create the task")
    if status is TaskStatus.SUCCEEDED:
        # The re-run writes the same chunk ids (ON CONFLICT DO NOTHING fills the gaps) and
        # switches the pointer if it is behind; at the same version it leaves it alone.
        return Repair(RepairAction.RERUN, version, task_id, "index the version again")
    if status in _LIVE:
        return Repair(RepairAction.NONE, version, task_id, f"its task is {status}: it will run")
    return Repair(
        RepairAction.NONE, version, task_id, f"its task is {status}: see kb tasks requeue"
    )


def _version(version: int | None) -> str:
    return "-" if version is None else f"v{version}"
