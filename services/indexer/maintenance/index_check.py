"""`kb index check`: find documents whose search state drifted from what was published, and
decide how each drift is repaired (docs/architecture.md#invariants).

The pipeline keeps the index right by construction (one fenced transaction moves chunks,
pointer, task and event together); drift is what a restore from backup, a hand-edited row
or a bug leaves behind, what no worker will fix by itself -- and documents served from
chunks that older code made -- and what a deleted document still holds that it may not
(its chunks, staged slices, served ACL, a pointer that is not its tombstone) or, once its
erase was asked for, anything the erase removes. Not drift: a version being indexed
(its task is live) and a FAILED one (its task is DEAD, shown on the document and the
operator page; `kb tasks requeue` is the operator's answer).

A repair of a live document only puts a task in motion; it has worked when the check run
after that task finished no longer shows the drift (``verify``). A deleted document's
leftovers are removed by the repair itself, by the erase's own fenced batches
(services/runtime/erasure), and an erase left half-done is finished; the check run after
it says whether they are gone.

Pure domain code: the adapter (``index_check_pg``) reads one row per document, carries out
the repairs this module decides and waits for their tasks.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from services.index.generation import chunking_settings
from services.runtime.erasure.leftovers import Leftovers
from services.runtime.indexing.tasks import TaskStatus


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
    # The served version was chunked by older code (parsers, splitter, tokenizer, our
    # chunker) than the indexers run now: its search answers are not what a re-index gives.
    OLDER_CHUNKING = "OLDER_CHUNKING"
    # A deleted document's pointer is not its tombstone, or it has none: a late completion
    # or a switch could serve it again.
    DELETED_NOT_TOMBSTONED = "DELETED_NOT_TOMBSTONED"
    # A deleted document's chunks (any version, any generation), staged slices or served
    # ACL rows: nothing serves them again (the delete is final), yet they hold its content
    # and principals.
    DELETED_CHUNKS = "DELETED_CHUNKS"
    DELETED_STAGED_SLICES = "DELETED_STAGED_SLICES"
    DELETED_ACL = "DELETED_ACL"
    # The document's erase was asked for and something it removes is still there, or it
    # never finished (erased_at unset).
    ERASE_UNFINISHED = "ERASE_UNFINISHED"


class RepairAction(enum.StrEnum):
    ENQUEUE = "ENQUEUE"  # create the missing task of the version
    RERUN = "RERUN"  # put the version's SUCCEEDED task back to PENDING
    NONE = "NONE"  # nothing to do by machine (see the reason)
    REMOVE = "REMOVE"  # tombstone the deleted document's pointer and remove its leftovers
    ERASE = "ERASE"  # that, then the document's erase again, to its end


# Repairs done by the repair itself (no task): the check after them says if they worked.
IN_PLACE = frozenset({RepairAction.REMOVE, RepairAction.ERASE})


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
    # The pointer's chunking strategy, and the one the indexers chunk its model with now
    # (its generation registered last); the versions of the code behind each, when recorded.
    served_strategy: str | None = None
    current_strategy: str | None = None
    served_code: Mapping[str, str] | None = None
    current_code: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Repair:
    action: RepairAction
    version_number: int | None
    task_id: uuid.UUID | None
    reason: str


@dataclass(frozen=True)
class Drift:
    kind: DriftKind
    state: DocumentIndexState | Leftovers
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
    elif served is not None and _chunked_otherwise(state):
        found.append(
            Drift(
                DriftKind.OLDER_CHUNKING,
                state,
                _older_chunking_detail(state),
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


def find_leftover_drift(left: Leftovers) -> list[Drift]:
    """Every drift of one deleted document, each with its count. Its repair removes all of
    them at once: a document whose erase was asked for is erased again to its end (never
    only marked erased), any other has its leftovers removed."""
    if left.erase_requested:
        repair = Repair(RepairAction.ERASE, None, None, "finish the erase")
    else:
        repair = Repair(RepairAction.REMOVE, None, None, "remove what it may not keep")
    found: list[Drift] = []
    if not left.tombstoned:
        pointer = "none" if left.pointer_version is None else f"v{left.pointer_version}"
        found.append(
            Drift(
                DriftKind.DELETED_NOT_TOMBSTONED,
                left,
                f"deleted, its pointer ({pointer}) is not its tombstone",
                repair,
            )
        )
    for kind, count, what in (
        (DriftKind.DELETED_CHUNKS, left.chunks, "chunk rows"),
        (DriftKind.DELETED_STAGED_SLICES, left.staged_slices, "staged slices"),
        (DriftKind.DELETED_ACL, left.served_acl, "served ACL rows"),
    ):
        if count:
            found.append(Drift(kind, left, f"deleted, {count} {what} left", repair))
    erase_left = left.erase_leftovers()
    if left.erase_requested and (erase_left or left.erased_at is None):
        what = ", ".join(f"{name} {count}" for name, count in erase_left.items())
        finished = "erased_at unset" if left.erased_at is None else "erased_at set"
        found.append(
            Drift(
                DriftKind.ERASE_UNFINISHED,
                left,
                f"erase asked for, {finished}" + (f"; left: {what}" if what else ""),
                repair,
            )
        )
    return found


def _chunked_otherwise(state: DocumentIndexState) -> bool:
    """The served version was chunked with the settings the indexers use now but by other
    code, and no newer version is on its way to replace it (a live task, or a drift of its
    own whose repair sends the pointer forward): only then is chunking it again worth its
    work, and a re-run replaces it (the sink replaces a served set of the same settings).

    Other chunk settings are another generation, not drift: a settings change applies to
    new versions, served ones keep their strategy (docs/operations.md)."""
    served_strategy, current_strategy = state.served_strategy, state.current_strategy
    if served_strategy is None or current_strategy is None:
        return False
    if served_strategy == current_strategy:
        return False
    if chunking_settings(served_strategy) != chunking_settings(current_strategy):
        return False
    published, served = state.published_version, state.served_version
    return published == served or state.published_task_status is TaskStatus.DEAD


def _older_chunking_detail(state: DocumentIndexState) -> str:
    changes = code_changes(state.served_code, state.current_code)
    what = ", ".join(changes) if changes else "its code's versions were not recorded"
    return f"served v{state.served_version} chunked by older code ({what})"


def code_changes(before: Mapping[str, str] | None, now: Mapping[str, str] | None) -> list[str]:
    """What differs between two recorded codes, as "name old -> new"; nothing when either was
    not recorded (a generation registered before the versions were)."""
    if not before or not now:
        return []
    return [
        f"{name} {before.get(name, '-')} -> {now.get(name, '-')}"
        for name in sorted(before.keys() | now.keys())
        if before.get(name) != now.get(name)
    ]


def _rerun(version: int, task_id: uuid.UUID | None, status: TaskStatus | None) -> Repair:
    if task_id is None:
        return Repair(RepairAction.ENQUEUE, version, None, "create the task")
    if status is TaskStatus.SUCCEEDED:
        # The re-run chunks the version with the indexers' code now and, at the served
        # version, replaces its chunk set and rewrites the pointer's count (the sink's
        # replace_version_chunks); behind the pointer, it switches it forward.
        return Repair(RepairAction.RERUN, version, task_id, "index the version again")
    if status in _LIVE:
        return Repair(RepairAction.NONE, version, task_id, f"its task is {status}: it will run")
    return Repair(
        RepairAction.NONE, version, task_id, f"its task is {status}: see kb tasks requeue"
    )


def _version(version: int | None) -> str:
    return "-" if version is None else f"v{version}"


# --- after the repair ---------------------------------------------------------------------


class Verdict(enum.StrEnum):
    # Its task finished SUCCEEDED (or its leftovers were removed) and the check run
    # afterwards no longer shows the drift.
    REPAIRED = "REPAIRED"
    # Its task finished SUCCEEDED (or its leftovers were removed), yet the check afterwards
    # still shows the drift.
    STILL_DRIFTING = "STILL_DRIFTING"
    # Its task ended DEAD.
    TASK_FAILED = "TASK_FAILED"
    # Its task had not finished when the wait ran out.
    NOT_FINISHED = "NOT_FINISHED"
    # Its task was queued and not waited for (no wait asked).
    NOT_VERIFIED = "NOT_VERIFIED"
    # Nothing was put in motion (no repair by machine, or the task changed meanwhile).
    NOT_REPAIRED = "NOT_REPAIRED"


_FINISHED = frozenset({TaskStatus.SUCCEEDED, TaskStatus.DEAD})


def is_finished(status: TaskStatus | None) -> bool:
    """A task the wait is over for: ended, or gone (a task is never deleted by the code)."""
    return status is None or status in _FINISHED


@dataclass(frozen=True)
class Verified:
    verdict: Verdict
    note: str


DriftKey: TypeAlias = tuple[str, uuid.UUID, DriftKind]


def drift_key(drift: Drift) -> DriftKey:
    return (drift.state.tenant_id, drift.state.document_id, drift.kind)


def verify(
    drift: Drift,
    *,
    queued: bool,
    note: str,
    task_status: TaskStatus | None,
    after: Collection[DriftKey] | None,
) -> Verified:
    """Whether the repair of ``drift`` worked: ``queued`` (and ``note``) say what the repair
    did, ``task_status`` is its task's status at the end of the wait, ``after`` the drifts
    of the check run after the wait (``None``: there was no wait)."""
    if not queued:
        return Verified(Verdict.NOT_REPAIRED, note)
    if drift.repair.action in IN_PLACE and after is not None:
        if drift_key(drift) in after:
            return Verified(Verdict.STILL_DRIFTING, "removed, the check after it still finds this")
        return Verified(Verdict.REPAIRED, "removed, the check after it no longer finds this")
    if after is None:
        return Verified(Verdict.NOT_VERIFIED, f"{note}; run kb index check once it has run")
    if task_status is TaskStatus.SUCCEEDED:
        if drift_key(drift) in after:
            return Verified(
                Verdict.STILL_DRIFTING, "its task SUCCEEDED, the check after it still finds this"
            )
        return Verified(
            Verdict.REPAIRED, "its task SUCCEEDED, the check after it no longer finds this"
        )
    if task_status is TaskStatus.DEAD:
        return Verified(Verdict.TASK_FAILED, "its task ended DEAD: see kb tasks requeue")
    if task_status is None:
        return Verified(Verdict.TASK_FAILED, "its task is gone")
    return Verified(
        Verdict.NOT_FINISHED, f"its task is still {task_status} after the wait: check again later"
    )


def appeared(before: Iterable[Drift], after: Iterable[Drift]) -> list[Drift]:
    """The drifts the check after the repair found that the first one had not."""
    known = {drift_key(d) for d in before}
    return [d for d in after if drift_key(d) not in known]
