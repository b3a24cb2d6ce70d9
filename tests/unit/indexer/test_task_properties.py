"""Property: whatever several workers do, in any order, with time moving on -- claim,
heartbeat, complete, fail, expire, requeue, a drift re-run -- a task never leaves the graph of
docs/architecture.md#states-and-transitions, its generation never goes back, and a worker whose
lease is not the current live one never
changes it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from services.indexer import task as model
from services.indexer.retry import RetryPolicy
from services.indexer.task import (
    PROVIDER_FAILURE_CODES,
    TRANSITIONS,
    ErrorCode,
    IndexTask,
    InvalidTransition,
    Lease,
    TaskStatus,
)
from services.runtime.errors import LeaseLost

START = datetime(2026, 1, 1, tzinfo=UTC)
LEASE_SECONDS = 30.0
PROVIDER_BUDGET = 600.0
WORKERS = ("w1", "w2")
CODES = (
    ErrorCode.EMBEDDING_TIMEOUT,
    ErrorCode.EMBEDDING_RATE_LIMITED,
    ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
    "DATABASE_BUSY",  # retriable by its flag, on the attempt budget
    ErrorCode.DOCUMENT_PARSE_FAILED,
    ErrorCode.EMBEDDING_MODEL_CHANGED,
)


@dataclass(frozen=True)
class Op:
    kind: str
    worker: str
    seconds: float = 0.0
    code: str = ErrorCode.EMBEDDING_TIMEOUT
    reset: bool = False
    # 0 = the worker's latest lease; n = the one it held n claims ago (a restarted process
    # with the same worker id still holding an old generation).
    back: int = 0


ops = st.one_of(
    st.builds(Op, st.just("claim"), st.sampled_from(WORKERS)),
    st.builds(Op, st.just("heartbeat"), st.sampled_from(WORKERS), back=st.integers(0, 2)),
    st.builds(Op, st.just("complete"), st.sampled_from(WORKERS), back=st.integers(0, 2)),
    st.builds(
        Op,
        st.just("fail"),
        st.sampled_from(WORKERS),
        code=st.sampled_from(CODES),
        back=st.integers(0, 2),
    ),
    st.builds(
        Op,
        st.just("advance"),
        st.just(""),
        seconds=st.sampled_from([1.0, 10.0, LEASE_SECONDS, 45.0, 120.0, PROVIDER_BUDGET]),
    ),
    st.builds(Op, st.just("requeue"), st.just("ops"), reset=st.booleans()),
    st.builds(Op, st.just("rerun"), st.just("check")),
)


def fresh(max_attempts: int) -> IndexTask:
    return IndexTask(
        task_id=uuid.uuid4(),
        tenant_id="acme",
        document_id=uuid.uuid4(),
        version_number=1,
        task_type=model.TASK_TYPE_INDEX_VERSION,
        tier="standard",
        status=TaskStatus.PENDING,
        attempts=0,
        max_attempts=max_attempts,
        lease_owner=None,
        lease_until=None,
        next_attempt_at=START,
        error_code=None,
        error_message=None,
        created_at=START,
        updated_at=START,
        finished_at=None,
    )


def holds(task: IndexTask, lease: Lease, now: datetime) -> bool:
    return (
        task.status is TaskStatus.RUNNING
        and task.lease_owner == lease.owner
        and task.attempts == lease.lease_attempt
        and task.lease_until is not None
        and task.lease_until > now
    )


@settings(max_examples=500, deadline=None)
@given(st.lists(ops, max_size=60), st.integers(min_value=1, max_value=5))
def test_random_histories_stay_in_the_graph_and_fence_out_stale_workers(
    history: list[Op], max_attempts: int
) -> None:
    policy = RetryPolicy(
        backoff_base_seconds=1,
        backoff_cap_seconds=20,
        jitter=0,
        provider_failure_budget_seconds=PROVIDER_BUDGET,
    )
    task = fresh(max_attempts)
    now = START
    leases: dict[str, list[Lease]] = {}
    for op in history:
        before = task
        held = leases.get(op.worker, [])
        lease = held[-1 - op.back] if op.back < len(held) else None
        try:
            if op.kind == "advance":
                now += timedelta(seconds=op.seconds)
                # What the claim statement does first: bury exhausted expired leases.
                if task.is_exhausted(now):
                    task = model.mark_exhausted(task, now)
            elif op.kind == "claim":
                task = model.claim(task, op.worker, now, LEASE_SECONDS)
                leases.setdefault(op.worker, []).append(model.lease_of(task))
            elif op.kind == "requeue":
                task, record = model.requeue(
                    task, by=op.worker, now=now, reset_attempts=op.reset, budget=3
                )
                assert record.attempts == before.attempts
            elif op.kind == "rerun":
                task, record = model.requeue(
                    task,
                    by=op.worker,
                    now=now,
                    reset_attempts=True,
                    budget=3,
                    from_status=TaskStatus.SUCCEEDED,
                )
                assert record.attempts == before.attempts
            elif lease is None:
                continue
            elif op.kind == "heartbeat":
                task = model.heartbeat(task, lease, now, LEASE_SECONDS)
            elif op.kind == "complete":
                task = model.complete(task, lease, now)
            else:
                decision = policy.decide(
                    lease, op.code, "failed", retriable=op.code == "DATABASE_BUSY" or None
                )
                task = model.fail(task, lease, decision, now)
        except LeaseLost:
            assert lease is not None
            assert not holds(before, lease, now), "a live lease was refused"
            assert task == before, "a refused write changed the task"
            continue
        except InvalidTransition:
            assert task == before
            continue

        if op.kind in ("heartbeat", "complete", "fail"):
            assert lease is not None
            assert holds(before, lease, now), "a stale worker changed the task"
        if task.status is not before.status or op.kind == "claim":
            assert (before.status, task.status) in TRANSITIONS
        assert task.attempts >= before.attempts, "the generation went back"
        if op.kind == "fail":
            provider = op.code in PROVIDER_FAILURE_CODES
            # A provider failure records its first time and, while it waits, hands back
            # the attempt its claim took; no other failure touches the budget.
            if provider:
                assert task.first_provider_failure_at is not None
                assert task.first_provider_failure_at <= now
            else:
                assert task.first_provider_failure_at == before.first_provider_failure_at
            granted = 1 if provider and task.status is TaskStatus.RETRY_WAIT else 0
            assert task.max_attempts == before.max_attempts + granted
            if provider and task.status is TaskStatus.RETRY_WAIT:
                assert task.first_provider_failure_at is not None
                budget_end = task.first_provider_failure_at + timedelta(seconds=PROVIDER_BUDGET)
                assert now < budget_end
                assert task.next_attempt_at <= budget_end
            if provider and task.status is TaskStatus.DEAD and decision.provider_budget_seconds:
                assert task.first_provider_failure_at is not None
                assert now - task.first_provider_failure_at >= timedelta(seconds=PROVIDER_BUDGET)
        if op.kind in ("requeue", "rerun"):
            assert task.first_provider_failure_at is None
        if task.status is TaskStatus.RUNNING:
            assert task.lease_owner is not None
            assert task.lease_until is not None
        assert task.status in TaskStatus
