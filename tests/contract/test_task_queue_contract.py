"""One contract for every TaskQueue: the PostgreSQL adapter and the in-memory fake must both
pass it (River's habit). Time is injected (ManualClock): leases expire without sleeping."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.indexer.ports import TaskQueue
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, FailureDecision, InvalidTransition, TaskStatus
from services.runtime.errors import LeaseLost, NotFound
from tests.fakes.task_queue import InMemoryTaskQueue
from tests.support.clock import ManualClock
from tests.support.tasks import create_task

LEASE = 30.0


@dataclass
class Harness:
    queue: TaskQueue
    clock: ManualClock
    _create: Callable[[str, str, int, datetime], Awaitable[uuid.UUID]]

    async def create(
        self,
        *,
        tenant_id: str = "acme",
        tier: str = "standard",
        max_attempts: int = 8,
        due_in: float = 0.0,
    ) -> uuid.UUID:
        due = self.clock.now() + timedelta(seconds=due_in)
        return await self._create(tenant_id, tier, max_attempts, due)

    async def status(self, task_id: uuid.UUID) -> TaskStatus:
        task = await self.queue.get(task_id)
        assert task is not None
        return task.status


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def backend(request: pytest.FixtureRequest) -> Any:
    """None for the fake; the real pool (a fresh migrated database) for PostgreSQL. A sync
    fixture, so the session stack starts outside the event loop."""
    return None if request.param == "memory" else request.getfixturevalue("pool")


@pytest.fixture
def harness(backend: Any) -> Harness:
    # Whole seconds: PostgreSQL keeps microseconds, comparisons stay exact on both sides.
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0))
    if backend is None:
        memory = InMemoryTaskQueue(clock)

        async def create_in_memory(
            tenant_id: str, tier: str, max_attempts: int, due: datetime
        ) -> uuid.UUID:
            task = memory.new_task(
                tenant_id=tenant_id, tier=tier, max_attempts=max_attempts, next_attempt_at=due
            )
            return task.task_id

        return Harness(memory, clock, create_in_memory)

    pool = backend

    async def create_in_postgres(
        tenant_id: str, tier: str, max_attempts: int, due: datetime
    ) -> uuid.UUID:
        created = await create_task(
            pool, tenant_id=tenant_id, tier=tier, max_attempts=max_attempts, next_attempt_at=due
        )
        return created.task_id

    return Harness(PgTaskQueue(pool, clock=clock), clock, create_in_postgres)


def _retry(code: str = ErrorCode.EMBEDDING_TIMEOUT, delay: float = 10.0) -> FailureDecision:
    return FailureDecision(TaskStatus.RETRY_WAIT, code, "timed out", delay)


def _dead(code: str = ErrorCode.DOCUMENT_PARSE_FAILED) -> FailureDecision:
    return FailureDecision(TaskStatus.DEAD, code, "corrupt", 0.0)


async def test_claim_takes_a_due_task_as_generation_one(harness: Harness) -> None:
    task_id = await harness.create()
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)

    assert lease.task_id == task_id
    assert lease.owner == "w1"
    assert lease.lease_attempt == 1
    assert lease.lease_until == harness.clock.now() + timedelta(seconds=LEASE)
    task = await harness.queue.get(task_id)
    assert task is not None
    assert task.status is TaskStatus.RUNNING
    assert task.attempts == 1
    assert task.lease_owner == "w1"
    # A running task with a live lease is nobody else's.
    assert await harness.queue.claim("standard", "w2", lease_seconds=LEASE) == []


async def test_claim_respects_tier_due_time_and_limit(harness: Harness) -> None:
    await harness.create(tier="premium")
    later = await harness.create(due_in=60)
    soon = [await harness.create() for _ in range(3)]

    first = await harness.queue.claim("standard", "w1", lease_seconds=LEASE, limit=2)
    second = await harness.queue.claim("standard", "w1", lease_seconds=LEASE, limit=5)
    assert len(first) == 2
    assert len(second) == 1
    assert {lease.task_id for lease in first + second} == set(soon)
    assert await harness.queue.claim("standard", "w1", lease_seconds=LEASE) == []
    for lease in first + second:
        await harness.queue.complete(lease)

    harness.clock.advance(60)
    [due_now] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    assert due_now.task_id == later
    assert await harness.status(later) is TaskStatus.RUNNING


async def test_heartbeat_extends_the_lease(harness: Harness) -> None:
    await harness.create()
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    harness.clock.advance(20)
    extended = await harness.queue.heartbeat(lease, lease_seconds=LEASE)
    assert extended.lease_until == harness.clock.now() + timedelta(seconds=LEASE)
    harness.clock.advance(20)  # past the first lease, within the extended one
    assert await harness.queue.claim("standard", "w2", lease_seconds=LEASE) == []
    await harness.queue.complete(extended)
    assert await harness.status(lease.task_id) is TaskStatus.SUCCEEDED


async def test_expired_lease_is_taken_over_and_the_old_holder_changes_nothing(
    harness: Harness,
) -> None:
    task_id = await harness.create()
    [old] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    harness.clock.advance(LEASE)  # lease_until <= now: expired

    [new] = await harness.queue.claim("standard", "w2", lease_seconds=LEASE)
    assert new.task_id == task_id
    assert new.lease_attempt == old.lease_attempt + 1
    before = await harness.queue.get(task_id)

    with pytest.raises(LeaseLost):
        await harness.queue.heartbeat(old, lease_seconds=LEASE)
    with pytest.raises(LeaseLost):
        await harness.queue.complete(old)
    with pytest.raises(LeaseLost):
        await harness.queue.fail(old, _dead())
    assert await harness.queue.get(task_id) == before

    await harness.queue.complete(new)
    assert await harness.status(task_id) is TaskStatus.SUCCEEDED


async def test_an_expired_lease_cannot_be_used_even_before_takeover(harness: Harness) -> None:
    task_id = await harness.create()
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    harness.clock.advance(LEASE + 1)
    before = await harness.queue.get(task_id)
    with pytest.raises(LeaseLost):
        await harness.queue.heartbeat(lease, lease_seconds=LEASE)
    with pytest.raises(LeaseLost):
        await harness.queue.complete(lease)
    assert await harness.queue.get(task_id) == before


async def test_same_worker_id_after_restart_cannot_use_its_old_generation(
    harness: Harness,
) -> None:
    task_id = await harness.create()
    [old] = await harness.queue.claim("standard", "worker-a", lease_seconds=LEASE)
    harness.clock.advance(LEASE)
    # The process restarts with the same configured worker id and claims the task again.
    [new] = await harness.queue.claim("standard", "worker-a", lease_seconds=LEASE)
    assert new.owner == old.owner
    assert new.lease_attempt == 2
    before = await harness.queue.get(task_id)

    for stale_write in (
        harness.queue.heartbeat(old, lease_seconds=LEASE),
        harness.queue.complete(old),
        harness.queue.fail(old, _retry()),
    ):
        with pytest.raises(LeaseLost):
            await stale_write
    assert await harness.queue.get(task_id) == before
    await harness.queue.heartbeat(new, lease_seconds=LEASE)


async def test_complete_runs_the_hook_in_its_transaction_and_is_final(harness: Harness) -> None:
    task_id = await harness.create()
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    calls: list[object] = []

    async def failing_hook(tx: object) -> None:
        calls.append(tx)
        raise RuntimeError("sink failed")

    with pytest.raises(RuntimeError, match="sink failed"):
        await harness.queue.complete(lease, in_transaction=failing_hook)
    # The hook's failure rolled the completion back: still ours, still RUNNING.
    assert await harness.status(task_id) is TaskStatus.RUNNING

    async def hook(tx: object) -> None:
        calls.append(tx)

    await harness.queue.complete(lease, in_transaction=hook)
    assert len(calls) == 2
    task = await harness.queue.get(task_id)
    assert task is not None
    assert task.status is TaskStatus.SUCCEEDED
    assert task.finished_at == harness.clock.now()
    with pytest.raises(LeaseLost):
        await harness.queue.complete(lease, in_transaction=hook)
    assert len(calls) == 2, "a fenced-out complete must not run the sink"


async def test_retryable_failure_waits_then_runs_as_the_next_generation(
    harness: Harness,
) -> None:
    task_id = await harness.create()
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    failed = await harness.queue.fail(lease, _retry(delay=10))
    assert failed.status is TaskStatus.RETRY_WAIT
    assert failed.error_code == ErrorCode.EMBEDDING_TIMEOUT
    assert failed.next_attempt_at == harness.clock.now() + timedelta(seconds=10)
    assert failed.lease_until is None

    harness.clock.advance(9)
    assert await harness.queue.claim("standard", "w1", lease_seconds=LEASE) == []
    harness.clock.advance(1)
    [retry] = await harness.queue.claim("standard", "w2", lease_seconds=LEASE)
    assert retry.task_id == task_id
    assert retry.lease_attempt == 2
    assert await harness.status(task_id) is TaskStatus.RUNNING


async def test_terminal_failure_is_dead_and_never_claimed(harness: Harness) -> None:
    await harness.create()
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    dead = await harness.queue.fail(lease, _dead())
    assert dead.status is TaskStatus.DEAD
    assert dead.error_code == ErrorCode.DOCUMENT_PARSE_FAILED
    assert dead.finished_at == harness.clock.now()
    harness.clock.advance(3600)
    assert await harness.queue.claim("standard", "w1", lease_seconds=LEASE) == []


async def test_expired_lease_with_budget_spent_goes_dead_and_stays_dead(
    harness: Harness,
) -> None:
    task_id = await harness.create(max_attempts=2)
    [first] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    harness.clock.advance(LEASE)
    [second] = await harness.queue.claim("standard", "w2", lease_seconds=LEASE)
    assert second.lease_attempt == 2
    harness.clock.advance(LEASE)

    assert await harness.queue.claim("standard", "w3", lease_seconds=LEASE) == []
    task = await harness.queue.get(task_id)
    assert task is not None
    assert task.status is TaskStatus.DEAD
    assert task.error_code == ErrorCode.LEASE_ATTEMPTS_EXHAUSTED
    assert task.attempts == 2
    harness.clock.advance(3600)
    assert await harness.queue.claim("standard", "w3", lease_seconds=LEASE) == []
    with pytest.raises(LeaseLost):
        await harness.queue.complete(second)
    assert first.lease_attempt == 1


async def test_requeue_of_dead_task_is_audited_and_keeps_the_generation(
    harness: Harness,
) -> None:
    task_id = await harness.create(max_attempts=3)
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    await harness.queue.fail(lease, _dead())

    record = await harness.queue.requeue(task_id, by="ops@acme", reset_attempts=False, budget=8)
    assert record.requeued_by == "ops@acme"
    assert record.requeued_at == harness.clock.now()
    assert record.reset_attempts is False
    assert record.previous_error_code == ErrorCode.DOCUMENT_PARSE_FAILED
    assert record.attempts == 1
    assert (record.previous_max_attempts, record.new_max_attempts) == (3, 2)
    task = await harness.queue.get(task_id)
    assert task is not None
    assert task.status is TaskStatus.PENDING
    assert task.error_code is None

    [again] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    assert again.lease_attempt == 2, "the fencing generation never repeats"
    with pytest.raises(LeaseLost):
        await harness.queue.complete(lease)
    await harness.queue.fail(again, _dead())
    reset = await harness.queue.requeue(task_id, by="ops", reset_attempts=True, budget=8)
    assert reset.new_max_attempts == 2 + 8
    history = await harness.queue.requeue_history(task_id)
    assert [(r.requeued_by, r.reset_attempts) for r in history] == [
        ("ops@acme", False),
        ("ops", True),
    ]


async def test_requeue_refuses_what_is_not_dead(harness: Harness) -> None:
    task_id = await harness.create()
    with pytest.raises(InvalidTransition):
        await harness.queue.requeue(task_id, by="ops", reset_attempts=False, budget=8)
    with pytest.raises(NotFound):
        await harness.queue.requeue(uuid.uuid4(), by="ops", reset_attempts=False, budget=8)
    assert await harness.status(task_id) is TaskStatus.PENDING


async def test_claims_take_turns_across_tenants_whatever_the_backlog(
    harness: Harness,
) -> None:
    # The busy tenant's tasks are all older than the quiet tenant's single task, and each
    # claimed task is finished before the next claim (one worker, one slot).
    for _ in range(30):
        await harness.create(tenant_id="busy", due_in=-60)
    quiet = await harness.create(tenant_id="quiet")

    served: list[str] = []
    for _ in range(2):  # T = 2 tenants: within one round of claims
        [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
        served.append(lease.tenant_id)
        await harness.queue.complete(lease)
    assert sorted(served) == ["busy", "quiet"]
    assert await harness.status(quiet) is TaskStatus.SUCCEEDED


async def test_a_tenant_holding_workers_yields_to_one_holding_none(harness: Harness) -> None:
    for _ in range(30):
        await harness.create(tenant_id="busy", due_in=-60)
    busy_leases = []
    for _ in range(3):
        busy_leases += await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    assert {lease.tenant_id for lease in busy_leases} == {"busy"}
    quiet = await harness.create(tenant_id="quiet")
    # Busy now holds 3 workers: its next task is in round 4, quiet's only one in round 1.
    [next_lease] = await harness.queue.claim("standard", "w2", lease_seconds=LEASE)
    assert next_lease.task_id == quiet


async def test_one_batch_serves_every_tenant_before_anyones_second(harness: Harness) -> None:
    for tenant in ("alpha", "beta", "gamma"):
        for _ in range(5):
            await harness.create(tenant_id=tenant, due_in=-60)
    batch = await harness.queue.claim("standard", "w1", lease_seconds=LEASE, limit=3)
    assert sorted(lease.tenant_id for lease in batch) == ["alpha", "beta", "gamma"]
    second = await harness.queue.claim("standard", "w1", lease_seconds=LEASE, limit=3)
    assert sorted(lease.tenant_id for lease in second) == ["alpha", "beta", "gamma"]


async def test_tenants_whose_tasks_all_wait_for_later_do_not_shrink_a_claim(
    harness: Harness,
) -> None:
    # Forty tenants whose only tasks failed and back off for an hour (RETRY_WAIT, not due)
    # must not count as tenants with due work: they would cut every tenant's share of the
    # candidates to one, and a claim of 8 would come back with 1.
    for n in range(40):
        await harness.create(tenant_id=f"waiting{n:02}")
    failed = await harness.queue.claim("standard", "w0", lease_seconds=LEASE, limit=40)
    assert len(failed) == 40
    for lease in failed:
        await harness.queue.fail(lease, _retry(delay=3600))
    due = {await harness.create(tenant_id="busy", due_in=-60) for _ in range(12)}

    batch = await harness.queue.claim("standard", "w1", lease_seconds=LEASE, limit=8)
    assert len(batch) == 8
    assert {lease.task_id for lease in batch} <= due


async def test_list_filters(harness: Harness) -> None:
    a = await harness.create(tenant_id="acme")
    b = await harness.create(tenant_id="globex", tier="premium")
    [lease] = await harness.queue.claim("premium", "w1", lease_seconds=LEASE)
    assert lease.task_id == b

    assert {t.task_id for t in await harness.queue.list_tasks()} == {a, b}
    assert [t.task_id for t in await harness.queue.list_tasks(status=TaskStatus.RUNNING)] == [b]
    assert [t.task_id for t in await harness.queue.list_tasks(tenant_id="acme")] == [a]
    assert [t.task_id for t in await harness.queue.list_tasks(tier="premium")] == [b]
    assert len(await harness.queue.list_tasks(limit=1)) == 1


async def test_retry_policy_decision_applies_through_the_queue(harness: Harness) -> None:
    task_id = await harness.create(max_attempts=2)
    policy = RetryPolicy(backoff_base_seconds=4, backoff_cap_seconds=100, jitter=0)
    [first] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    waited = await harness.queue.fail(
        first, policy.decide(first, "DATABASE_BUSY", "busy", retriable=True)
    )
    assert waited.status is TaskStatus.RETRY_WAIT
    assert waited.max_attempts == 2  # an attempt spent
    assert waited.first_provider_failure_at is None
    harness.clock.advance(4)
    [second] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    # Budget spent: a retryable failure on the last attempt is final, with its own code.
    final = await harness.queue.fail(
        second, policy.decide(second, "DATABASE_BUSY", "busy", retriable=True)
    )
    assert final.status is TaskStatus.DEAD
    assert final.error_code == "DATABASE_BUSY"
    assert final.task_id == task_id


# --- the provider failure time budget ----------------------------------------------------------

DAY = 86_400.0


async def _provider_failure(
    harness: Harness,
    policy: RetryPolicy,
    code: str = ErrorCode.EMBEDDING_UNAVAILABLE,
    *,
    retry_after: float | None = None,
) -> Any:
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    decision = policy.decide(lease, code, "503 from the provider", retry_after_seconds=retry_after)
    return await harness.queue.fail(lease, decision)


async def test_a_provider_failure_records_its_first_time_and_spends_no_attempt(
    harness: Harness,
) -> None:
    task_id = await harness.create(max_attempts=2)
    policy = RetryPolicy(backoff_base_seconds=4, backoff_cap_seconds=100, jitter=0)
    start = harness.clock.now()
    first = await _provider_failure(harness, policy)
    assert (first.status, first.first_provider_failure_at) == (TaskStatus.RETRY_WAIT, start)
    assert (first.attempts, first.max_attempts) == (1, 3)  # the claim's attempt handed back
    assert first.next_attempt_at == start + timedelta(seconds=4)
    harness.clock.advance(4)
    second = await _provider_failure(harness, policy, ErrorCode.EMBEDDING_RESPONSE_MALFORMED)
    assert second.status is TaskStatus.RETRY_WAIT
    assert second.first_provider_failure_at == start  # the first one's time is kept
    assert (second.attempts, second.max_attempts) == (2, 4)
    # Another kind of failure neither sets nor clears it, and spends an attempt.
    harness.clock.advance(8)
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    busy = await harness.queue.fail(
        lease, policy.decide(lease, "DATABASE_BUSY", "busy", retriable=True)
    )
    assert (busy.status, busy.max_attempts, busy.first_provider_failure_at) == (
        TaskStatus.RETRY_WAIT,
        4,
        start,
    )
    assert busy.task_id == task_id


async def test_provider_failures_retry_for_the_whole_budget_then_end_dead(
    harness: Harness,
) -> None:
    task_id = await harness.create(max_attempts=2)
    policy = RetryPolicy(jitter=0)  # 24 h budget
    start = harness.clock.now()
    await _provider_failure(harness, policy)
    # 23 hours on: still waiting, the attempt budget as it was (2 attempts left).
    harness.clock.advance(23 * 3600)
    waiting = await _provider_failure(harness, policy, ErrorCode.EMBEDDING_TIMEOUT)
    assert waiting.status is TaskStatus.RETRY_WAIT
    assert waiting.max_attempts - waiting.attempts == 2
    # A Retry-After beyond the budget's end parks the task to that end, not beyond it.
    harness.clock.advance(3600 - 60)
    parked = await _provider_failure(
        harness, policy, ErrorCode.EMBEDDING_RATE_LIMITED, retry_after=3600
    )
    assert parked.status is TaskStatus.RETRY_WAIT
    assert parked.next_attempt_at == start + timedelta(seconds=DAY)
    harness.clock.advance(59)
    assert await harness.queue.claim("standard", "w1", lease_seconds=LEASE) == []
    harness.clock.advance(1)
    dead = await _provider_failure(harness, policy, ErrorCode.EMBEDDING_UNAVAILABLE)
    assert (dead.status, dead.error_code) == (TaskStatus.DEAD, ErrorCode.EMBEDDING_UNAVAILABLE)
    assert dead.finished_at == harness.clock.now()
    assert dead.first_provider_failure_at == start
    assert dead.max_attempts == parked.max_attempts  # nothing granted to a DEAD task
    assert dead.error_message is not None
    assert "86400 s budget" in dead.error_message
    assert "503 from the provider" in dead.error_message
    harness.clock.advance(DAY)
    assert await harness.queue.claim("standard", "w1", lease_seconds=LEASE) == []
    assert await harness.status(task_id) is TaskStatus.DEAD

    # A requeue starts the budget afresh.
    await harness.queue.requeue(task_id, by="ops", reset_attempts=False, budget=8)
    requeued = await harness.queue.get(task_id)
    assert requeued is not None
    assert requeued.first_provider_failure_at is None
    again = await _provider_failure(harness, policy)
    assert again.status is TaskStatus.RETRY_WAIT
    assert again.first_provider_failure_at == harness.clock.now()


async def test_a_30_minute_retry_after_parks_the_task(harness: Harness) -> None:
    task_id = await harness.create()
    parked = await _provider_failure(
        harness, RetryPolicy(jitter=0), ErrorCode.EMBEDDING_RATE_LIMITED, retry_after=1800
    )
    assert (parked.status, parked.error_code) == (
        TaskStatus.RETRY_WAIT,
        ErrorCode.EMBEDDING_RATE_LIMITED,
    )
    assert parked.next_attempt_at == harness.clock.now() + timedelta(minutes=30)
    harness.clock.advance(1799)
    assert await harness.queue.claim("standard", "w1", lease_seconds=LEASE) == []
    harness.clock.advance(1)
    [lease] = await harness.queue.claim("standard", "w1", lease_seconds=LEASE)
    assert lease.task_id == task_id
