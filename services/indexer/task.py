"""Index tasks: the five states, the only transitions between them, the lease and the fence.

Pure Python (docs/architecture.md#index-tasks): no driver, no clock of its own. The states
and the row are the shared vocabulary of services.runtime.indexing.tasks. The PostgreSQL adapter
applies the same rules in SQL; the in-memory fake of the tests applies them through the
functions below; one contract suite holds both to the same behaviour. The retry policy,
which decides what a failure does, is beside it in retry.py.

Fencing: ``attempts`` after a claim is the lease generation (``lease_attempt``). It only ever
grows: not on retry, not on takeover, not on requeue (a requeue renews the *budget* by
raising ``max_attempts``, and so does a provider failure's retry, which spends none), so a
worker holding an old generation can never match a fence again, even with the same worker
id after a restart.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Final

from services.runtime.errors import Conflict, LeaseLost
from services.runtime.indexing.index_failures import (
    PROVIDER_FAILURE_CODES as PROVIDER_FAILURE_CODES,
)
from services.runtime.indexing.index_failures import RETRYABLE_CODES as RETRYABLE_CODES
from services.runtime.indexing.index_failures import TERMINAL_CODES as TERMINAL_CODES
from services.runtime.indexing.index_failures import ErrorCode as ErrorCode
from services.runtime.indexing.index_failures import IndexingFailed as IndexingFailed
from services.runtime.indexing.index_failures import redact as redact
from services.runtime.indexing.tasks import TASK_TYPE_INDEX_VERSION as TASK_TYPE_INDEX_VERSION
from services.runtime.indexing.tasks import IndexTaskRecord
from services.runtime.indexing.tasks import TaskStatus as TaskStatus
from services.runtime.pg.records import copied

# Every edge of docs/architecture.md#states-and-transitions. RUNNING -> RUNNING is a takeover
# of an expired lease (a new generation); heartbeats keep RUNNING without a new generation and
# are not an edge.
TRANSITIONS: Final[frozenset[tuple[TaskStatus, TaskStatus]]] = frozenset(
    {
        (TaskStatus.PENDING, TaskStatus.RUNNING),  # claim
        (TaskStatus.RETRY_WAIT, TaskStatus.RUNNING),  # claim of a due retry
        (TaskStatus.RUNNING, TaskStatus.RUNNING),  # takeover of an expired lease
        (TaskStatus.RUNNING, TaskStatus.SUCCEEDED),  # complete
        (TaskStatus.RUNNING, TaskStatus.RETRY_WAIT),  # fail, retryable, budget left
        (TaskStatus.RUNNING, TaskStatus.DEAD),  # fail terminal / a budget spent / lease exhausted
        (TaskStatus.DEAD, TaskStatus.PENDING),  # operator requeue
        (TaskStatus.SUCCEEDED, TaskStatus.PENDING),  # drift repair re-run (kb index check)
    }
)


class InvalidTransition(Conflict):
    code = "INVALID_TASK_TRANSITION"


@dataclass(frozen=True)
class IndexTask(IndexTaskRecord):
    """The shared task row, with the questions the state graph asks of it, and the columns
    only the indexer reads: ``first_provider_failure_at``, when the task's first provider-side
    failure was recorded (its time budget runs from there; NULL: none since it was created or
    last requeued)."""

    first_provider_failure_at: datetime | None = None
    # The search generation the task builds (NULL: the tenant's serving one when it is
    # indexed) and its claim priority within the tenant (0 publishes, 1 backfills).
    generation_id: int | None = None
    priority: int = 0

    def is_due(self, now: datetime) -> bool:
        """Claimable now: a due PENDING/RETRY_WAIT task, or an expired lease with budget left."""
        if self.status in (TaskStatus.PENDING, TaskStatus.RETRY_WAIT):
            return self.next_attempt_at <= now
        return (
            self.status is TaskStatus.RUNNING
            and self.lease_expired(now)
            and (self.attempts < self.max_attempts)
        )

    def lease_expired(self, now: datetime) -> bool:
        return (
            self.status is TaskStatus.RUNNING
            and self.lease_until is not None
            and self.lease_until <= now
        )

    def is_exhausted(self, now: datetime) -> bool:
        """Its lease ran out and no attempt is left: the claim marks it DEAD."""
        return self.lease_expired(now) and self.attempts >= self.max_attempts


@dataclass(frozen=True)
class Lease:
    """What a worker holds after a claim: the fence it must present on every write."""

    task_id: uuid.UUID
    owner: str
    lease_attempt: int
    lease_until: datetime
    tenant_id: str
    document_id: uuid.UUID
    version_number: int
    task_type: str
    tier: str
    max_attempts: int
    # The search generation the task builds; None: the tenant's serving one, resolved by
    # the indexer (services.indexer.pipeline.generations).
    generation_id: int | None = None

    def log_fields(self) -> dict[str, Any]:
        """The task and the version it indexes, as log lines name them."""
        return {
            "task_id": str(self.task_id),
            "tenant_id": self.tenant_id,
            "document_id": str(self.document_id),
            "version_number": self.version_number,
        }


@dataclass(frozen=True)
class FailureDecision:
    """Where a failed attempt goes: RETRY_WAIT after ``delay_seconds``, or DEAD.

    A provider-side failure on its time budget (``provider_budget_seconds`` set) is settled by
    the fenced fail itself, which alone reads the task's ``first_provider_failure_at`` and the
    database's ``now`` (:func:`settle`): RETRY_WAIT until at most the budget's end, with one
    more attempt granted (``max_attempts + 1``: it spends none of the attempt budget), or DEAD
    with ``budget_spent_message`` once the budget is spent."""

    status: TaskStatus
    error_code: str
    error_message: str
    delay_seconds: float
    provider_budget_seconds: float | None = None
    budget_spent_message: str | None = None

    def __post_init__(self) -> None:
        if self.provider_budget_seconds is not None and (
            self.status is not TaskStatus.RETRY_WAIT
            or not self.provider_failure
            or self.budget_spent_message is None
        ):
            raise ValueError(
                "a provider budget goes with RETRY_WAIT, a provider-side code and a "
                "budget_spent_message"
            )

    @property
    def provider_failure(self) -> bool:
        """A provider-side code: the fail records the task's first such failure."""
        return self.error_code in PROVIDER_FAILURE_CODES


@dataclass(frozen=True)
class RequeueRecord:
    """The audit of one operator requeue."""

    task_id: uuid.UUID
    requeued_by: str
    requeued_at: datetime
    reset_attempts: bool
    attempts: int
    previous_max_attempts: int
    new_max_attempts: int
    previous_error_code: str | None
    previous_error_message: str | None


# --- transitions ---------------------------------------------------------------------------


def fence(task: IndexTask, lease: Lease, now: datetime) -> None:
    """The fence (docs/architecture.md#leases-and-fencing): status RUNNING, same owner, same
    generation, lease not expired."""
    holds = (
        task.task_id == lease.task_id
        and task.status is TaskStatus.RUNNING
        and task.lease_owner == lease.owner
        and task.attempts == lease.lease_attempt
        and task.lease_until is not None
        and task.lease_until > now
    )
    if not holds:
        raise LeaseLost(f"task {lease.task_id} lease {lease.lease_attempt} of {lease.owner} lost")


def claim(task: IndexTask, owner: str, now: datetime, lease_seconds: float) -> IndexTask:
    if not task.is_due(now):
        raise InvalidTransition(f"task {task.task_id} is {task.status} and not claimable")
    return replace(
        task,
        status=TaskStatus.RUNNING,
        attempts=task.attempts + 1,
        lease_owner=owner,
        lease_until=now + timedelta(seconds=lease_seconds),
        updated_at=now,
    )


def mark_exhausted(task: IndexTask, now: datetime) -> IndexTask:
    if not task.is_exhausted(now):
        raise InvalidTransition(f"task {task.task_id} is not an exhausted expired lease")
    return replace(
        task,
        status=TaskStatus.DEAD,
        lease_until=None,
        error_code=ErrorCode.LEASE_ATTEMPTS_EXHAUSTED,
        error_message=f"lease expired {task.attempts} times; attempt budget "
        f"{task.max_attempts} spent",
        updated_at=now,
        finished_at=now,
    )


def lease_of(task: IndexTask) -> Lease:
    assert task.status is TaskStatus.RUNNING
    assert task.lease_owner is not None
    assert task.lease_until is not None
    # The task's own fields by name; the lease's three under the names a lease gives them.
    return copied(
        Lease,
        task,
        owner=task.lease_owner,
        lease_attempt=task.attempts,
        lease_until=task.lease_until,
    )


def heartbeat(task: IndexTask, lease: Lease, now: datetime, lease_seconds: float) -> IndexTask:
    fence(task, lease, now)
    return replace(task, lease_until=now + timedelta(seconds=lease_seconds), updated_at=now)


def complete(task: IndexTask, lease: Lease, now: datetime) -> IndexTask:
    fence(task, lease, now)
    return replace(
        task,
        status=TaskStatus.SUCCEEDED,
        lease_until=None,
        error_code=None,
        error_message=None,
        updated_at=now,
        finished_at=now,
    )


@dataclass(frozen=True)
class Settled:
    """What a fail writes besides the code: the decision applied to the row at ``now``."""

    status: TaskStatus
    error_message: str
    next_attempt_at: datetime
    max_attempts: int
    first_provider_failure_at: datetime | None


def settle(task: IndexTask, decision: FailureDecision, now: datetime) -> Settled:
    """The decision applied to the task at ``now``, as ``fail_task`` (queries.sql) does it in
    SQL: a provider-side code records the first such failure (kept if there was one); on the
    time budget, a task whose budget has run out (``now >= first + budget``) goes DEAD with
    ``budget_spent_message``, else RETRY_WAIT no later than the budget's end and with
    ``max_attempts + 1``."""
    first = task.first_provider_failure_at
    if decision.provider_failure and first is None:
        first = now
    budget = decision.provider_budget_seconds
    if budget is None:
        return Settled(
            decision.status,
            decision.error_message,
            now + timedelta(seconds=decision.delay_seconds),
            task.max_attempts,
            first,
        )
    assert first is not None  # a provider code: set above
    assert decision.budget_spent_message is not None  # FailureDecision checks it
    budget_end = first + timedelta(seconds=budget)
    if budget_end <= now:
        return Settled(
            TaskStatus.DEAD, decision.budget_spent_message, now, task.max_attempts, first
        )
    return Settled(
        TaskStatus.RETRY_WAIT,
        decision.error_message,
        min(now + timedelta(seconds=decision.delay_seconds), budget_end),
        task.max_attempts + 1,
        first,
    )


def fail(task: IndexTask, lease: Lease, decision: FailureDecision, now: datetime) -> IndexTask:
    fence(task, lease, now)
    settled = settle(task, decision, now)
    return replace(
        task,
        status=settled.status,
        max_attempts=settled.max_attempts,
        lease_until=None,
        next_attempt_at=settled.next_attempt_at,
        error_code=decision.error_code,
        error_message=settled.error_message,
        updated_at=now,
        finished_at=now if settled.status is TaskStatus.DEAD else None,
        first_provider_failure_at=settled.first_provider_failure_at,
    )


def requeue(
    task: IndexTask,
    *,
    by: str,
    now: datetime,
    reset_attempts: bool,
    budget: int,
    from_status: TaskStatus = TaskStatus.DEAD,
) -> tuple[IndexTask, RequeueRecord]:
    """A finished task back to PENDING: an operator's requeue of a DEAD task, or
    (``from_status`` SUCCEEDED) `kb index check --repair` re-running a drifted version, which
    also forgets the worker that completed it. ``attempts`` (the fencing generation) is kept;
    ``reset_attempts`` renews a full budget of ``budget`` attempts, otherwise the task gets
    exactly one more attempt. The provider failure time budget starts afresh."""
    if from_status not in (TaskStatus.DEAD, TaskStatus.SUCCEEDED):
        raise ValueError(f"a task is requeued from DEAD or SUCCEEDED, not {from_status}")
    if task.status is not from_status:
        raise InvalidTransition(
            f"task {task.task_id} is {task.status}; only {from_status} is requeued here"
        )
    new_max = requeued_max_attempts(task.attempts, reset_attempts=reset_attempts, budget=budget)
    record = RequeueRecord(
        task_id=task.task_id,
        requeued_by=by,
        requeued_at=now,
        reset_attempts=reset_attempts,
        attempts=task.attempts,
        previous_max_attempts=task.max_attempts,
        new_max_attempts=new_max,
        previous_error_code=task.error_code,
        previous_error_message=task.error_message,
    )
    requeued = replace(
        task,
        status=TaskStatus.PENDING,
        max_attempts=new_max,
        lease_owner=None if from_status is TaskStatus.SUCCEEDED else task.lease_owner,
        lease_until=None,
        next_attempt_at=now,
        error_code=None,
        error_message=None,
        updated_at=now,
        finished_at=None,
        first_provider_failure_at=None,
    )
    return requeued, record


def requeued_max_attempts(attempts: int, *, reset_attempts: bool, budget: int) -> int:
    return attempts + (budget if reset_attempts else 1)
