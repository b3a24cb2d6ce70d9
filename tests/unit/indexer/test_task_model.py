"""The pure task model: the state graph, the fence, requeue, and the retry policy."""

from __future__ import annotations

import math
import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.indexer import task as model
from services.indexer.retry import RetryPolicy
from services.indexer.task import (
    PROVIDER_FAILURE_CODES,
    RETRYABLE_CODES,
    TERMINAL_CODES,
    TRANSITIONS,
    ErrorCode,
    IndexingFailed,
    IndexTask,
    InvalidTransition,
    TaskStatus,
    redact,
)
from services.runtime.errors import DatabaseBusy, DatabaseUnavailable, KafkaUnavailable, LeaseLost

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def pending(max_attempts: int = 3) -> IndexTask:
    return IndexTask(
        task_id=uuid.uuid4(),
        tenant_id="acme",
        document_id=uuid.uuid4(),
        version_number=2,
        task_type=model.TASK_TYPE_INDEX_VERSION,
        tier="standard",
        status=TaskStatus.PENDING,
        attempts=0,
        max_attempts=max_attempts,
        lease_owner=None,
        lease_until=None,
        next_attempt_at=NOW,
        error_code=None,
        error_message=None,
        created_at=NOW,
        updated_at=NOW,
        finished_at=None,
    )


def test_the_graph_is_exactly_design_section_4() -> None:
    S = TaskStatus
    assert {
        (S.PENDING, S.RUNNING),
        (S.RETRY_WAIT, S.RUNNING),
        (S.RUNNING, S.RUNNING),
        (S.RUNNING, S.SUCCEEDED),
        (S.RUNNING, S.RETRY_WAIT),
        (S.RUNNING, S.DEAD),
        (S.DEAD, S.PENDING),
        (S.SUCCEEDED, S.PENDING),
    } == TRANSITIONS
    # A finished task leaves its state only back to PENDING (a requeue or a drift re-run).
    assert {to for source, to in TRANSITIONS if source in (S.SUCCEEDED, S.DEAD)} == {S.PENDING}
    assert TERMINAL_CODES.isdisjoint(RETRYABLE_CODES)


def test_claim_needs_a_due_task_and_starts_a_new_generation() -> None:
    task = model.claim(pending(), "w1", NOW, 30)
    assert task.status is TaskStatus.RUNNING
    assert task.attempts == 1
    assert task.lease_until == NOW + timedelta(seconds=30)
    with pytest.raises(InvalidTransition):
        model.claim(task, "w2", NOW, 30)  # lease still live
    later = replace_due(pending(), NOW + timedelta(seconds=5))
    with pytest.raises(InvalidTransition):
        model.claim(later, "w1", NOW, 30)
    taken = model.claim(task, "w2", NOW + timedelta(seconds=30), 30)
    assert (taken.lease_owner, taken.attempts) == ("w2", 2)


def replace_due(task: IndexTask, when: datetime) -> IndexTask:
    from dataclasses import replace

    return replace(task, next_attempt_at=when)


def test_the_fence_checks_owner_generation_status_and_expiry() -> None:
    running = model.claim(pending(), "w1", NOW, 30)
    lease = model.lease_of(running)
    from dataclasses import replace

    for stale in (
        replace(lease, owner="w2"),
        replace(lease, lease_attempt=lease.lease_attempt - 1),
        replace(lease, task_id=uuid.uuid4()),
    ):
        with pytest.raises(LeaseLost):
            model.heartbeat(running, stale, NOW, 30)
    with pytest.raises(LeaseLost):
        model.complete(running, lease, NOW + timedelta(seconds=30))  # expired at lease_until
    done = model.complete(running, lease, NOW + timedelta(seconds=29))
    with pytest.raises(LeaseLost):
        model.complete(done, lease, NOW)


def test_exhausted_expired_lease_is_dead_with_its_code() -> None:
    running = model.claim(pending(max_attempts=1), "w1", NOW, 30)
    assert not running.is_exhausted(NOW)
    later = NOW + timedelta(seconds=30)
    assert running.is_exhausted(later)
    assert not running.is_due(later)
    dead = model.mark_exhausted(running, later)
    assert dead.status is TaskStatus.DEAD
    assert dead.error_code == ErrorCode.LEASE_ATTEMPTS_EXHAUSTED
    assert not dead.is_due(later + timedelta(days=1))


def test_requeue_only_from_dead_and_keeps_the_generation() -> None:
    with pytest.raises(InvalidTransition):
        model.requeue(pending(), by="ops", now=NOW, reset_attempts=True, budget=5)
    running = model.claim(pending(max_attempts=1), "w1", NOW, 30)
    dead = model.mark_exhausted(running, NOW + timedelta(seconds=31))
    again, record = model.requeue(dead, by="ops", now=NOW, reset_attempts=False, budget=5)
    assert again.status is TaskStatus.PENDING
    assert again.attempts == 1
    assert again.max_attempts == 2
    assert record.previous_error_code == ErrorCode.LEASE_ATTEMPTS_EXHAUSTED
    _, reset = model.requeue(dead, by="ops", now=NOW, reset_attempts=True, budget=5)
    assert reset.new_max_attempts == 6
    with pytest.raises(InvalidTransition):
        model.requeue(
            dead,
            by="check",
            now=NOW,
            reset_attempts=True,
            budget=5,
            from_status=TaskStatus.SUCCEEDED,
        )
    with pytest.raises(ValueError, match="DEAD or SUCCEEDED"):
        model.requeue(
            running,
            by="x",
            now=NOW,
            reset_attempts=True,
            budget=5,
            from_status=TaskStatus.RUNNING,
        )


def test_a_drift_rerun_takes_a_succeeded_task_back_to_pending_under_a_new_generation() -> None:
    running = model.claim(pending(max_attempts=3), "w1", NOW, 30)
    done = model.complete(running, model.lease_of(running), NOW)
    rerun, record = model.requeue(
        done,
        by="kb index check --repair",
        now=NOW,
        reset_attempts=True,
        budget=5,
        from_status=TaskStatus.SUCCEEDED,
    )
    assert (rerun.status, rerun.attempts, rerun.max_attempts) == (TaskStatus.PENDING, 1, 6)
    assert rerun.lease_owner is None  # the worker that completed it is forgotten
    assert (record.attempts, record.previous_max_attempts) == (1, 3)
    # The next claim is a new generation: the old lease can never complete it again.
    again = model.claim(rerun, "w2", NOW, 30)
    assert again.attempts == 2
    with pytest.raises(LeaseLost):
        model.complete(again, model.lease_of(running), NOW)


def lease_at(attempt: int, max_attempts: int = 10) -> model.Lease:
    task = pending(max_attempts)
    from dataclasses import replace

    running = replace(
        task, status=TaskStatus.RUNNING, attempts=attempt, lease_owner="w", lease_until=NOW
    )
    return model.lease_of(running)


@pytest.mark.parametrize("code", sorted(TERMINAL_CODES))
def test_terminal_codes_go_dead_at_once(code: str) -> None:
    decision = RetryPolicy().decide(lease_at(1), code, "broken")
    assert decision.status is TaskStatus.DEAD
    assert decision.error_code == code


def test_unknown_codes_are_not_dressed_up_as_retryable() -> None:
    assert RetryPolicy().decide(lease_at(1), "KEY_ERROR", "bug").status is TaskStatus.DEAD


@pytest.mark.parametrize(
    "code",
    [
        ErrorCode.EMBEDDING_TIMEOUT,
        ErrorCode.EMBEDDING_UNAVAILABLE,
        ErrorCode.EMBEDDING_RATE_LIMITED,
    ],
)
def test_retryable_codes_wait_and_back_off_exponentially_up_to_the_cap(code: str) -> None:
    policy = RetryPolicy(backoff_base_seconds=2, backoff_cap_seconds=60, jitter=0)
    delays = [policy.decide(lease_at(n), code, "slow").delay_seconds for n in range(1, 9)]
    assert delays == [2, 4, 8, 16, 32, 60, 60, 60]
    assert all(policy.decide(lease_at(1), code, "x").status is TaskStatus.RETRY_WAIT for _ in "ab")


def test_an_error_that_says_it_is_retriable_waits_whatever_its_code() -> None:
    # A DatabaseBusy (DATABASE_BUSY) or any later infrastructure error: the flag decides,
    # not a list of codes the policy happens to know, and never the message.
    policy = RetryPolicy(backoff_base_seconds=2, backoff_cap_seconds=60, jitter=0)
    decision = policy.decide(lease_at(2), "SOMETHING_TRANSIENT", "busy", retriable=True)
    assert (decision.status, decision.delay_seconds) == (TaskStatus.RETRY_WAIT, 4)
    assert policy.decide(lease_at(1), "SOMETHING_TRANSIENT", "x").status is TaskStatus.DEAD
    spent = policy.decide(lease_at(5, max_attempts=5), "SOMETHING_TRANSIENT", "x", retriable=True)
    assert spent.status is TaskStatus.DEAD


def test_infrastructure_codes_retry_by_their_flag_not_by_a_copy_of_their_code() -> None:
    policy = RetryPolicy(backoff_base_seconds=2, backoff_cap_seconds=60, jitter=0)
    for error in (DatabaseUnavailable("gone"), DatabaseBusy("slow"), KafkaUnavailable("down")):
        assert error.code not in RETRYABLE_CODES  # no string copy of what the flag says
        flagged = policy.decide(lease_at(1), error.code, "x", retriable=error.retriable)
        assert flagged.status is TaskStatus.RETRY_WAIT
        # The code alone, without its flag, is not retried.
        assert policy.decide(lease_at(1), error.code, "x").status is TaskStatus.DEAD
    # A stand-in for an error class that stopped being retriable: its flag wins.
    assert policy.decide(lease_at(1), "DATABASE_BUSY", "x", retriable=False).status is (
        TaskStatus.DEAD
    )


def test_indexing_failed_takes_its_flag_from_the_code_table_unless_told() -> None:
    assert IndexingFailed(ErrorCode.EMBEDDING_TIMEOUT, "slow").retriable
    assert not IndexingFailed(ErrorCode.DOCUMENT_PARSE_FAILED, "corrupt").retriable
    assert not IndexingFailed("SOMETHING_NEW", "odd").retriable
    assert IndexingFailed("SOMETHING_NEW", "odd", retriable=True).retriable
    assert not IndexingFailed(ErrorCode.EMBEDDING_TIMEOUT, "x", retriable=False).retriable
    assert not IndexingFailed.retriable  # the class itself is not


@pytest.mark.parametrize("code", sorted(TERMINAL_CODES))
def test_a_terminal_code_stays_terminal_even_if_flagged_retriable(code: str) -> None:
    assert RetryPolicy().decide(lease_at(1), code, "x", retriable=True).status is TaskStatus.DEAD


def test_jitter_only_shortens_and_spreads_the_backoff() -> None:
    policy = RetryPolicy(backoff_base_seconds=10, backoff_cap_seconds=1000, jitter=0.2)
    rng = random.Random(7)
    delays = [policy.backoff_seconds(3, rng) for _ in range(200)]
    assert all(32 <= d <= 40 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100


def test_retry_after_is_honoured_even_above_the_backoff() -> None:
    policy = RetryPolicy(backoff_base_seconds=1, backoff_cap_seconds=10, jitter=0)
    decision = policy.decide(
        lease_at(1), ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=120
    )
    assert decision.status is TaskStatus.RETRY_WAIT
    assert decision.delay_seconds == 120
    short = policy.decide(
        lease_at(3), ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=0.5
    )
    assert short.delay_seconds == 4  # the backoff is longer than what the provider asked


@pytest.mark.parametrize("retry_after", [1e9, 600.001, math.inf, math.nan])
def test_a_retry_after_beyond_the_limit_ends_a_non_provider_failure_dead(
    retry_after: float,
) -> None:
    # Defect: a Retry-After of 1e9 s parked the task in RETRY_WAIT for decades. Outside the
    # provider budget (a retriable error of another kind) the limit still ends it DEAD.
    policy = RetryPolicy(backoff_base_seconds=2, backoff_cap_seconds=600, jitter=0)
    decision = policy.decide(
        lease_at(1), "SOMETHING_TRANSIENT", "busy", retry_after_seconds=retry_after, retriable=True
    )
    assert (decision.status, decision.error_code) == (TaskStatus.DEAD, "SOMETHING_TRANSIENT")
    assert "Retry-After" in decision.error_message
    assert "600 s" in decision.error_message
    # Up to the limit (the backoff cap by default) it is waited for.
    at_limit = policy.decide(
        lease_at(1), "SOMETHING_TRANSIENT", "busy", retry_after_seconds=600, retriable=True
    )
    assert (at_limit.status, at_limit.delay_seconds) == (TaskStatus.RETRY_WAIT, 600)


@pytest.mark.parametrize("retry_after", [1e9, 86_400.5, math.inf, math.nan])
def test_a_provider_retry_after_beyond_the_budget_parks_the_task_to_its_end(
    retry_after: float,
) -> None:
    # A provider that asks for longer than the budget (or for nonsense) is not a reason to
    # give the document up at once: the task waits to the end of its budget, then gets one
    # more try before the budget decides.
    policy = RetryPolicy(jitter=0)
    decision = policy.decide(
        lease_at(1), ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=retry_after
    )
    assert (decision.status, decision.delay_seconds) == (TaskStatus.RETRY_WAIT, 86_400)
    assert decision.provider_budget_seconds == 86_400


def test_the_retry_after_limit_is_configurable() -> None:
    policy = RetryPolicy(backoff_cap_seconds=60, max_retry_after_seconds=3600)
    assert policy.retry_after_limit == 3600
    waits = policy.decide(
        lease_at(1), "SOMETHING_TRANSIENT", "x", retry_after_seconds=1800, retriable=True
    )
    assert (waits.status, waits.delay_seconds) == (TaskStatus.RETRY_WAIT, 1800)
    assert RetryPolicy(backoff_cap_seconds=60).retry_after_limit == 60
    with pytest.raises(ValueError, match="max_retry_after_seconds"):
        RetryPolicy(max_retry_after_seconds=0)
    for budget in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="provider_failure_budget_seconds"):
            RetryPolicy(provider_failure_budget_seconds=budget)


def test_a_spent_budget_is_final_with_the_last_code() -> None:
    decision = RetryPolicy().decide(
        lease_at(5, max_attempts=5), "SOMETHING_TRANSIENT", "x", retriable=True
    )
    assert decision.status is TaskStatus.DEAD
    assert decision.error_code == "SOMETHING_TRANSIENT"


# --- the provider failure time budget (a clock that moves only when told) ----------------------

BUDGET = 86_400.0
POLICY = RetryPolicy(jitter=0)  # backoff 2 s doubling to 600 s; budget 24 h


def provider_failure(
    task: IndexTask,
    now: datetime,
    code: str = ErrorCode.EMBEDDING_UNAVAILABLE,
    *,
    retry_after: float | None = None,
) -> IndexTask:
    """One attempt at ``now``: claim, then a provider-side failure through the policy."""
    running = model.claim(task, "w", now, 30)
    lease = model.lease_of(running)
    decision = POLICY.decide(lease, code, "provider down", retry_after_seconds=retry_after)
    return model.fail(running, lease, decision, now)


def test_provider_failures_for_23_hours_keep_waiting_and_spend_no_attempt() -> None:
    task = pending(max_attempts=3)
    now = NOW
    failures = 0
    while now < NOW + timedelta(hours=23):
        task = provider_failure(task, now)
        failures += 1
        assert task.status is TaskStatus.RETRY_WAIT
        assert task.first_provider_failure_at == NOW
        # The generation grew by one per attempt; the attempt budget is what it was.
        assert task.attempts == failures
        assert task.max_attempts - task.attempts == 3
        now = task.next_attempt_at
    assert failures > 8, "more provider failures than the attempt budget"
    # The budget for other failures is untouched: three more attempts for those.
    for left in (2, 1):
        running = model.claim(task, "w", now, 30)
        lease = model.lease_of(running)
        decision = POLICY.decide(lease, "DATABASE_BUSY", "busy", retriable=True)
        task = model.fail(running, lease, decision, now)
        assert (task.status, task.max_attempts - task.attempts) == (TaskStatus.RETRY_WAIT, left)
        assert task.first_provider_failure_at == NOW  # another kind of failure keeps it
        now = task.next_attempt_at


def test_provider_failures_past_24_hours_end_dead_with_a_message_that_says_so() -> None:
    task = provider_failure(pending(), NOW, ErrorCode.EMBEDDING_TIMEOUT)
    # Still within the budget a second before its end.
    almost = NOW + timedelta(seconds=BUDGET - 1)
    task = provider_failure(replace_due(task, almost), almost, ErrorCode.EMBEDDING_TIMEOUT)
    assert task.status is TaskStatus.RETRY_WAIT
    # Its wait never runs past the budget's end: the next try is at the end, at the latest.
    assert task.next_attempt_at == NOW + timedelta(seconds=BUDGET)
    end = task.next_attempt_at
    dead = provider_failure(task, end, ErrorCode.EMBEDDING_RATE_LIMITED)
    assert (dead.status, dead.error_code) == (TaskStatus.DEAD, ErrorCode.EMBEDDING_RATE_LIMITED)
    assert dead.finished_at == end
    assert dead.first_provider_failure_at == NOW
    assert dead.error_message is not None
    assert "86400 s budget" in dead.error_message
    assert "KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS" in dead.error_message
    assert "provider down" in dead.error_message  # and the last failure itself
    assert dead.max_attempts == task.max_attempts  # no attempt granted to a DEAD task
    assert not dead.is_due(end + timedelta(days=30))


def test_a_30_minute_retry_after_parks_the_task_instead_of_killing_it() -> None:
    parked = provider_failure(pending(), NOW, ErrorCode.EMBEDDING_RATE_LIMITED, retry_after=1800)
    assert parked.status is TaskStatus.RETRY_WAIT
    assert parked.next_attempt_at == NOW + timedelta(minutes=30)
    assert not parked.is_due(NOW + timedelta(minutes=29, seconds=59))
    assert parked.is_due(NOW + timedelta(minutes=30))
    assert parked.max_attempts - parked.attempts == 3


def test_a_burst_of_malformed_answers_is_retried_then_the_task_succeeds() -> None:
    # A proxy's HTML error page answered with 200, five times: more than the attempt budget.
    task = pending(max_attempts=3)
    now = NOW
    for _ in range(5):
        task = provider_failure(task, now, ErrorCode.EMBEDDING_RESPONSE_MALFORMED)
        assert (task.status, task.error_code) == (
            TaskStatus.RETRY_WAIT,
            ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
        )
        now = task.next_attempt_at
    running = model.claim(task, "w", now, 30)
    assert model.complete(running, model.lease_of(running), now).status is TaskStatus.SUCCEEDED


@pytest.mark.parametrize(
    "code", [ErrorCode.EMBEDDING_RESPONSE_INVALID, ErrorCode.EMBEDDING_MODEL_CHANGED]
)
def test_a_wrong_answer_is_terminal_not_a_provider_failure(code: str) -> None:
    # A vector of the wrong dimension, count or model: the same request would get it again.
    assert code not in PROVIDER_FAILURE_CODES
    running = model.claim(pending(), "w", NOW, 30)
    lease = model.lease_of(running)
    error = IndexingFailed(code, "expected 384 dimensions, got 383")
    decision = POLICY.decide(lease, error.code, error.message, retriable=error.retriable)
    dead = model.fail(running, lease, decision, NOW)
    assert (dead.status, dead.error_code) == (TaskStatus.DEAD, code)
    assert dead.first_provider_failure_at is None


def test_the_provider_codes_are_retryable_and_malformed_is_one_of_them() -> None:
    assert (
        frozenset(
            {
                ErrorCode.EMBEDDING_RATE_LIMITED,
                ErrorCode.EMBEDDING_TIMEOUT,
                ErrorCode.EMBEDDING_UNAVAILABLE,
                ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
            }
        )
        == PROVIDER_FAILURE_CODES
    )
    assert PROVIDER_FAILURE_CODES <= RETRYABLE_CODES
    assert IndexingFailed(ErrorCode.EMBEDDING_RESPONSE_MALFORMED, "<html>").retriable


def test_a_provider_code_flagged_not_retriable_is_dead_but_still_recorded() -> None:
    running = model.claim(pending(), "w", NOW, 30)
    lease = model.lease_of(running)
    decision = POLICY.decide(lease, ErrorCode.EMBEDDING_TIMEOUT, "x", retriable=False)
    assert decision.provider_budget_seconds is None
    dead = model.fail(running, lease, decision, NOW)
    assert dead.status is TaskStatus.DEAD
    assert dead.first_provider_failure_at == NOW


def test_a_requeue_starts_the_provider_budget_afresh() -> None:
    task = provider_failure(pending(), NOW)
    end = NOW + timedelta(seconds=BUDGET)
    dead = provider_failure(replace_due(task, end), end)
    assert dead.status is TaskStatus.DEAD
    later = end + timedelta(hours=1)
    again, _ = model.requeue(dead, by="ops", now=later, reset_attempts=False, budget=8)
    assert again.first_provider_failure_at is None
    retried = provider_failure(again, later)
    assert retried.status is TaskStatus.RETRY_WAIT
    assert retried.first_provider_failure_at == later


def test_a_budget_decision_must_be_a_provider_retry() -> None:
    with pytest.raises(ValueError, match="provider budget"):
        model.FailureDecision(
            TaskStatus.RETRY_WAIT,
            "DATABASE_BUSY",
            "x",
            1.0,
            provider_budget_seconds=10.0,
            budget_spent_message="spent",
        )
    with pytest.raises(ValueError, match="provider budget"):
        model.FailureDecision(
            TaskStatus.DEAD,
            ErrorCode.EMBEDDING_TIMEOUT,
            "x",
            0.0,
            provider_budget_seconds=10.0,
            budget_spent_message="spent",
        )


def test_messages_are_redacted_and_bounded() -> None:
    text = redact(
        "POST failed: Authorization: Bearer sk-abc.def token=xyz123 "
        "postgresql://kb:hunter2@db/kb api_key='k-9'"
    )
    for secret in ("sk-abc.def", "xyz123", "hunter2", "k-9"):
        assert secret not in text
    assert "postgresql://kb:***@db/kb" in text
    assert len(redact("x" * 5000)) == 1000
