"""Index tasks: the five states, the only transitions between them, and the retry policy.

Pure Python (docs/architecture.md#index-tasks): no driver, no clock of its own. The states
and the row are the shared vocabulary of services.runtime.tasks. The PostgreSQL adapter
applies the same rules in SQL; the in-memory fake of the tests applies them through the
functions below; one contract suite holds both to the same behaviour.

Fencing: ``attempts`` after a claim is the lease generation (``lease_attempt``). It only ever
grows: not on retry, not on takeover, not on requeue (a requeue renews the *budget* by
raising ``max_attempts``), so a worker holding an old generation can never match a fence
again, even with the same worker id after a restart.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Final

from services.runtime.backoff import Backoff
from services.runtime.errors import Conflict, LeaseLost
from services.runtime.index_failures import RETRYABLE_CODES as RETRYABLE_CODES
from services.runtime.index_failures import TERMINAL_CODES as TERMINAL_CODES
from services.runtime.index_failures import ErrorCode as ErrorCode
from services.runtime.index_failures import IndexingFailed as IndexingFailed
from services.runtime.index_failures import redact as redact
from services.runtime.tasks import TASK_TYPE_INDEX_VERSION as TASK_TYPE_INDEX_VERSION
from services.runtime.tasks import IndexTaskRecord
from services.runtime.tasks import TaskStatus as TaskStatus

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
        (TaskStatus.RUNNING, TaskStatus.DEAD),  # fail terminal / budget spent / lease exhausted
        (TaskStatus.DEAD, TaskStatus.PENDING),  # operator requeue
    }
)


class InvalidTransition(Conflict):
    code = "INVALID_TASK_TRANSITION"


@dataclass(frozen=True)
class IndexTask(IndexTaskRecord):
    """The shared task row, with the questions the state graph asks of it."""

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
    """Where a failed attempt goes: RETRY_WAIT after ``delay_seconds``, or DEAD."""

    status: TaskStatus
    error_code: str
    error_message: str
    delay_seconds: float


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
    return Lease(
        task_id=task.task_id,
        owner=task.lease_owner,
        lease_attempt=task.attempts,
        lease_until=task.lease_until,
        tenant_id=task.tenant_id,
        document_id=task.document_id,
        version_number=task.version_number,
        task_type=task.task_type,
        tier=task.tier,
        max_attempts=task.max_attempts,
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


def fail(task: IndexTask, lease: Lease, decision: FailureDecision, now: datetime) -> IndexTask:
    fence(task, lease, now)
    dead = decision.status is TaskStatus.DEAD
    return replace(
        task,
        status=decision.status,
        lease_until=None,
        next_attempt_at=now + timedelta(seconds=decision.delay_seconds),
        error_code=decision.error_code,
        error_message=decision.error_message,
        updated_at=now,
        finished_at=now if dead else None,
    )


def requeue(
    task: IndexTask, *, by: str, now: datetime, reset_attempts: bool, budget: int
) -> tuple[IndexTask, RequeueRecord]:
    """Operator requeue of a DEAD task. ``attempts`` (the fencing generation) is kept;
    ``reset_attempts`` renews a full budget of ``budget`` attempts, otherwise the task gets
    exactly one more attempt."""
    if task.status is not TaskStatus.DEAD:
        raise InvalidTransition(f"task {task.task_id} is {task.status}; only DEAD can be requeued")
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
        lease_until=None,
        next_attempt_at=now,
        error_code=None,
        error_message=None,
        updated_at=now,
        finished_at=None,
    )
    return requeued, record


def requeued_max_attempts(attempts: int, *, reset_attempts: bool, budget: int) -> int:
    return attempts + (budget if reset_attempts else 1)


# --- retry policy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Decide by code and the error's ``retriable`` flag, never by message: terminal codes
    go DEAD at once; a retriable error (the flag; for a bare code, ``RETRYABLE_CODES``)
    waits the shared backoff (services.runtime.backoff: exponential, capped, jittered),
    never less than the provider's Retry-After; once the attempt budget is spent the task
    goes DEAD with its last code.

    A Retry-After longer than ``max_retry_after_seconds`` (default: the backoff cap) is not
    waited for: the task goes DEAD with its code at once, and the message says why. A
    provider that asks for hours (or 1e9 s) has shut us out; parking the task in RETRY_WAIT
    for that long would leave it stuck where nobody looks, while DEAD is where operators
    look and requeue from."""

    backoff_base_seconds: float = 2.0
    backoff_cap_seconds: float = 600.0
    jitter: float = 0.2
    max_retry_after_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_retry_after_seconds is not None and not self.max_retry_after_seconds > 0:
            raise ValueError("max_retry_after_seconds must be > 0")

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_base_seconds, self.backoff_cap_seconds, self.jitter)

    @property
    def retry_after_limit(self) -> float:
        if self.max_retry_after_seconds is None:
            return self.backoff_cap_seconds
        return self.max_retry_after_seconds

    def backoff_seconds(self, lease_attempt: int, rng: random.Random | None = None) -> float:
        return self.backoff.delay(lease_attempt, rng)

    def decide(
        self,
        lease: Lease,
        error_code: str,
        error_message: str,
        *,
        retry_after_seconds: float | None = None,
        retriable: bool | None = None,
        rng: random.Random | None = None,
    ) -> FailureDecision:
        message = redact(error_message)
        flagged = error_code in RETRYABLE_CODES if retriable is None else retriable
        if not flagged or error_code in TERMINAL_CODES:
            return FailureDecision(TaskStatus.DEAD, error_code, message, 0.0)
        if lease.lease_attempt >= lease.max_attempts:
            return FailureDecision(TaskStatus.DEAD, error_code, message, 0.0)
        delay = self.backoff_seconds(lease.lease_attempt, rng)
        if retry_after_seconds is not None:
            limit = self.retry_after_limit
            # NaN compares false with everything: "not <=" treats it as beyond the limit.
            if not retry_after_seconds <= limit:
                return FailureDecision(
                    TaskStatus.DEAD,
                    error_code,
                    redact(
                        f"{error_message} (Retry-After {retry_after_seconds:g} s is beyond "
                        f"the {limit:g} s a task may wait)"
                    ),
                    0.0,
                )
            delay = max(delay, retry_after_seconds)
        return FailureDecision(TaskStatus.RETRY_WAIT, error_code, message, delay)
