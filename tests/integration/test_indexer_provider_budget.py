"""Provider-side failures on their time budget, end to end: a real Worker and the real
pipeline on PostgreSQL, the test provider over real HTTP failing on purpose, the clock
injected (a day passes without sleeping).

- a 30-minute Retry-After parks the task (RETRY_WAIT, next_attempt_at), it does not kill it;
- a burst of malformed 200s (a proxy's HTML page) is retried past the attempt budget, and
  the task then succeeds;
- a wrong-dimension answer is terminal at once;
- failures for 23 h still wait with the attempt budget intact; past 24 h the task is DEAD
  with a message that says why (and takes any staged slices with it).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.embedding.factory import build_embedder
from services.embedding.port import Embedder
from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.indexer.pipeline.version_indexer import PipelineIndexer
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, TaskStatus
from tests.integration.test_pipeline_stream_pg import staged
from tests.support.clock import ManualClock
from tests.support.embedding_provider import EmbeddingProvider, ServedProvider, served_provider
from tests.support.pipeline import running_pipeline
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

DIMENSION = 64
DAY = timedelta(days=1)


@pytest.fixture
def served() -> Iterator[ServedProvider]:
    with served_provider(EmbeddingProvider(dimension=DIMENSION)) as provider:
        yield provider


@pytest.fixture
def clock() -> ManualClock:
    # Whole seconds: PostgreSQL keeps microseconds, comparisons stay exact on both sides.
    return ManualClock(datetime.now(UTC).replace(microsecond=0))


def http_embedder(served: ServedProvider) -> Embedder:
    return build_embedder(
        EmbeddingSettings(
            provider=OpenAIConfig(
                base_url=served.base_url, model="test-embed", dimensions=DIMENSION
            )
        )
    )


@pytest.fixture
async def indexer(
    pool: asyncpg.Pool[Any], served: ServedProvider, clock: ManualClock
) -> AsyncIterator[PipelineIndexer]:
    async with running_pipeline(pool, embedder=http_embedder(served), clock=clock) as pipeline:
        yield pipeline


def worker(pool: asyncpg.Pool[Any], indexer: PipelineIndexer, clock: ManualClock) -> Worker:
    return Worker(
        PgTaskQueue(pool, clock=clock),
        indexer,
        tier="standard",
        owner="it-provider-budget",
        policy=RetryPolicy(jitter=0),  # backoff 2 s doubling to 600 s; the budget 24 h
    )


async def task_row(pool: asyncpg.Pool[Any], task_id: uuid.UUID) -> Any:
    row = await pool.fetchrow(
        "SELECT status, error_code, error_message, attempts, max_attempts, next_attempt_at,"
        " first_provider_failure_at, finished_at FROM index_task WHERE task_id = $1",
        task_id,
    )
    assert row is not None
    return row


async def chunks(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> int:
    count: int = await pool.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", document_id
    )
    return count


async def test_a_30_minute_retry_after_parks_the_task_and_it_succeeds_after(
    pool: asyncpg.Pool[Any], served: ServedProvider, indexer: PipelineIndexer, clock: ManualClock
) -> None:
    created = await create_task(pool, max_attempts=2, next_attempt_at=clock.now())
    run = worker(pool, indexer, clock)
    served.control.inject("rate_limit", retry_after="1800")  # until cleared
    start = clock.now()
    # Three tries, each answered 429 "come back in 30 minutes": more than the task's two
    # attempts, and every one parks it instead of ending it.
    for tries in (1, 2, 3):
        assert await run.run_once() is RunOnceResult.FAILED
        row = await task_row(pool, created.task_id)
        assert (row["status"], row["error_code"]) == (
            "RETRY_WAIT",
            ErrorCode.EMBEDDING_RATE_LIMITED,
        )
        assert row["next_attempt_at"] == clock.now() + timedelta(minutes=30)
        assert row["first_provider_failure_at"] == start
        assert (row["attempts"], row["max_attempts"] - row["attempts"]) == (tries, 2)
        clock.advance(1799)
        assert await run.run_once() is RunOnceResult.IDLE  # parked until then
        clock.advance(1)
    served.control.clear_faults()
    assert await run.run_once() is RunOnceResult.SUCCEEDED
    assert (await task_row(pool, created.task_id))["status"] == "SUCCEEDED"
    assert await chunks(pool, created.document_id) > 0
    assert [r.fault for r in served.provider.requests].count("rate_limit") == 3


async def test_a_burst_of_malformed_200s_is_retried_then_the_task_succeeds(
    pool: asyncpg.Pool[Any], served: ServedProvider, indexer: PipelineIndexer, clock: ManualClock
) -> None:
    created = await create_task(pool, max_attempts=2, next_attempt_at=clock.now())
    run = worker(pool, indexer, clock)
    served.control.inject("not_json", times=4)  # a proxy's HTML page, four times over
    for _ in range(4):
        assert await run.run_once() is RunOnceResult.FAILED
        row = await task_row(pool, created.task_id)
        assert (row["status"], row["error_code"]) == (
            "RETRY_WAIT",
            ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
        )
        assert row["max_attempts"] - row["attempts"] == 2  # no attempt spent
        clock.set(row["next_attempt_at"])
    assert await run.run_once() is RunOnceResult.SUCCEEDED
    assert await chunks(pool, created.document_id) > 0
    assert [r.fault for r in served.provider.requests].count("not_json") == 4


async def test_a_wrong_dimension_answer_is_terminal(
    pool: asyncpg.Pool[Any], served: ServedProvider, indexer: PipelineIndexer, clock: ManualClock
) -> None:
    created = await create_task(pool, next_attempt_at=clock.now())
    served.control.inject("wrong_dimension", times=1)
    assert await worker(pool, indexer, clock).run_once() is RunOnceResult.FAILED
    row = await task_row(pool, created.task_id)
    assert (row["status"], row["error_code"]) == ("DEAD", ErrorCode.EMBEDDING_RESPONSE_INVALID)
    assert row["first_provider_failure_at"] is None  # not a provider-side failure
    assert row["attempts"] == 1


async def test_provider_failures_wait_for_23_hours_and_end_dead_past_24(
    pool: asyncpg.Pool[Any], served: ServedProvider, indexer: PipelineIndexer, clock: ManualClock
) -> None:
    created = await create_task(pool, max_attempts=2, next_attempt_at=clock.now())
    run = worker(pool, indexer, clock)
    served.control.inject("status", status=503)  # until cleared
    start = clock.now()
    assert await run.run_once() is RunOnceResult.FAILED
    row = await task_row(pool, created.task_id)
    assert (row["status"], row["error_code"]) == ("RETRY_WAIT", ErrorCode.EMBEDDING_UNAVAILABLE)
    assert row["first_provider_failure_at"] == start

    # 23 hours later, still down: still waiting, the attempt budget as it was.
    clock.advance(23 * 3600)
    assert await run.run_once() is RunOnceResult.FAILED
    row = await task_row(pool, created.task_id)
    assert row["status"] == "RETRY_WAIT"
    assert (row["attempts"], row["max_attempts"] - row["attempts"]) == (2, 2)
    assert row["first_provider_failure_at"] == start

    # 24 hours from the first failure: DEAD, with a message that says why.
    clock.set(start + DAY)
    assert await run.run_once() is RunOnceResult.FAILED
    row = await task_row(pool, created.task_id)
    assert (row["status"], row["error_code"]) == ("DEAD", ErrorCode.EMBEDDING_UNAVAILABLE)
    assert row["finished_at"] == clock.now()
    assert "86400 s budget" in row["error_message"]
    assert "KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS" in row["error_message"]
    assert "503" in row["error_message"]
    assert await chunks(pool, created.document_id) == 0
    clock.advance(7 * 86_400)
    assert await run.run_once() is RunOnceResult.IDLE


async def test_a_task_dead_of_its_spent_budget_takes_its_staged_slices_with_it(
    pool: asyncpg.Pool[Any], clock: ManualClock
) -> None:
    # The slices a crashed attempt left (a failed attempt deletes its own): the fail that
    # ends the task DEAD on its time budget deletes them, as any fail to DEAD does; the
    # fails before it, to RETRY_WAIT, keep them for the next attempt to delete.
    created = await create_task(pool, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    policy = RetryPolicy(jitter=0, provider_failure_budget_seconds=3600)
    for offset in (0, 3600):
        clock.advance(offset)
        [lease] = await queue.claim("standard", "w", lease_seconds=30)
        await pool.execute(
            "INSERT INTO knowledge_chunk_stream (task_id, lease_attempt, chunk_id, ordinal,"
            " heading_path, text, content_digest, embedding)"
            " VALUES ($1, $2, 'c0', 0, '{}', 'left over', '\\x00', '[1,2,3]')",
            created.task_id,
            lease.lease_attempt,
        )
        decision = policy.decide(lease, ErrorCode.EMBEDDING_TIMEOUT, "timed out")
        failed = await queue.fail(lease, decision)
        if offset == 0:
            assert failed.status is TaskStatus.RETRY_WAIT
            assert await staged(pool, created.task_id) == {1: 1}
    assert failed.status is TaskStatus.DEAD
    assert await staged(pool, created.task_id) == {}
