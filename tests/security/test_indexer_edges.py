"""Issue 41, the indexer's edges, on real PostgreSQL:

- a finished task keeps its lease while its completion waits in the group queue (and while
  it commits): a completion held up longer than a lease still ends SUCCEEDED on its first
  attempt, and no other worker takes the task over meanwhile;
- one Retry-After of a year does not stop the fleet: the shared pause is capped, a longer
  one opens the breaker instead, and once the provider recovers the indexer indexes again;
- `kb index generations retire` and a committing backfill lock their rows in one order:
  a retire that meets a completion of its generation waits for it instead of deadlocking;
- an indexer restarted with another embedding model while tenants are still served by the
  default one refuses to start (exit 2) instead of moving their search to a model none of
  their pointers names.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg
import numpy as np
import pytest

from services.embedding.factory import build_embedder
from services.embedding.guard.breaker import BreakerState
from services.embedding.guard.factory import build_guard, guarded, quota_plan
from services.embedding.guard.quota import Purpose
from services.embedding.guard.store_pg import PgProviderStateStore
from services.embedding.hashing import HashingEmbedder
from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.index.generation import IndexGeneration
from services.indexer.generations.retire import PgRetirement
from services.indexer.pipeline.version_indexer import chunking_strategy, index_generation
from services.indexer.queue.attempt import RunOnceResult
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import Worker
from services.indexer.sink.pgvector import PgVectorSink
from services.runtime.commands.cli_support import exit_code
from services.runtime.errors import ConfigError
from tests.support import versions
from tests.support.completions import database_clock_passes, held_and_queued
from tests.support.embedding_provider import EmbeddingProvider, served_provider
from tests.support.generations import (
    NEW_MODEL,
    NEW_STRATEGY,
    OLD_MODEL,
    add_document,
    new_generation,
    register_default,
)
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.paused import PausedWrite
from tests.support.pipeline import running_pipeline
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

DIMENSION = 8
GENERATION = IndexGeneration("test-edges-8", DIMENSION, "heading-semchunk-v1:max=256")


async def test_a_completion_queued_longer_than_its_lease_keeps_the_lease(
    pool: asyncpg.Pool[Any],
) -> None:
    lease_seconds = 3.0
    # One group commits at a time: the second completion waits behind the first.
    queue = PgTaskQueue(pool, committing_groups=1)
    held, queued, paused, events, attempts = await held_and_queued(
        pool, queue, GENERATION, lease_seconds=lease_seconds
    )
    first = asyncio.create_task(attempts.process(held))
    second: asyncio.Task[RunOnceResult] | None = None
    try:
        await paused.reached.wait()  # the first group is committing, and stays so
        second = asyncio.create_task(attempts.process(queued))
        # The second task is indexed; its completion waits in the queue past its first lease.
        await database_clock_passes(pool, queued.lease_until, events, lease_seconds / 3)
        # Another worker finds nothing to take over.
        rescued = await queue.claim("standard", "rescuer", lease_seconds=lease_seconds, limit=2)
        assert rescued == []
    finally:
        paused.release.set()
        results = await asyncio.gather(first, *([second] if second else []), return_exceptions=True)
    assert results == [RunOnceResult.SUCCEEDED, RunOnceResult.SUCCEEDED]
    row = await pool.fetchrow(
        "SELECT status, attempts, lease_owner FROM index_task WHERE task_id = $1", queued.task_id
    )
    assert row is not None
    assert (row["status"], row["attempts"], row["lease_owner"]) == ("SUCCEEDED", 1, "w1")


async def test_a_refused_heartbeat_withdraws_a_queued_completion(
    pool: asyncpg.Pool[Any],
) -> None:
    lease_seconds = 3.0
    queue = PgTaskQueue(pool, committing_groups=1)
    held, queued, paused, _, attempts = await held_and_queued(
        pool, queue, GENERATION, lease_seconds=lease_seconds
    )
    first = asyncio.create_task(attempts.process(held))
    try:
        await paused.reached.wait()
        second = asyncio.create_task(attempts.process(queued))
        # Another worker took the queued task over: its next beat is refused, and the
        # completion goes at once, without waiting for the group ahead of it.
        await pool.execute(
            "UPDATE index_task SET lease_owner = 'rescuer', attempts = attempts + 1"
            " WHERE task_id = $1",
            queued.task_id,
        )
        async with asyncio.timeout(10 * lease_seconds):
            assert await second is RunOnceResult.LOST_LEASE
        assert not first.done()
    finally:
        paused.release.set()
    assert await first is RunOnceResult.SUCCEEDED
    row = await pool.fetchrow(
        "SELECT status, lease_owner FROM index_task WHERE task_id = $1", queued.task_id
    )
    assert row is not None
    assert (row["status"], row["lease_owner"]) == ("RUNNING", "rescuer")  # untouched


A_YEAR = 365 * 24 * 3600


async def test_a_year_long_retry_after_opens_the_breaker_and_the_indexer_recovers(
    pool: asyncpg.Pool[Any],
) -> None:
    with served_provider(EmbeddingProvider(dimension=32)) as served:
        settings = EmbeddingSettings(
            provider=OpenAIConfig(base_url=served.base_url, model="edges", dimensions=32),
            breaker_open_seconds=0.5,
            breaker_max_open_seconds=0.5,
            guard_refresh_seconds=0,
        )
        embedder, guard = guarded(
            settings, build_embedder(settings), pool, purpose=Purpose.INDEX, owner="w-edges"
        )
        assert guard is not None
        throttled = await create_task(pool, content=b"A note the provider throttles.\n")
        # One answer: 429, come back in a year.
        served.control.inject("rate_limit", retry_after=str(A_YEAR), times=1)
        async with running_pipeline(pool, embedder=embedder) as indexer:
            worker = Worker(
                PgTaskQueue(pool), indexer, tier="standard", owner="w-edges", gate=guard
            )
            assert await worker.run_once() is RunOnceResult.FAILED
            view = await guard.view()
            # Nobody is paused for a year: the breaker opened instead, and it probes.
            assert not view.paused or view.seconds_until(view.paused_until) <= 300
            assert view.state is BreakerState.OPEN
            assert view.breaker.last_failure_code == "EMBEDDING_RATE_LIMITED"
            fresh = await create_task(pool, content=b"A note published after the throttle.\n")
            # The provider answers again (its fault was one answer): once the breaker's
            # open time is up a claim probes, succeeds, and both tasks are indexed -- the
            # throttled one too, not parked until its Retry-After.
            deadline = time.monotonic() + 60
            while await _statuses(pool, throttled.task_id, fresh.task_id) != ["SUCCEEDED"] * 2:
                assert time.monotonic() < deadline, await guard.view()
                if await worker.run_once() is RunOnceResult.IDLE:
                    await asyncio.sleep(0.1)  # the open time and a backoff passing
            assert (await guard.view()).state is BreakerState.CLOSED


async def test_a_year_long_pause_already_shared_is_cut_to_the_cap(
    pool: asyncpg.Pool[Any],
) -> None:
    settings = EmbeddingSettings(
        provider=OpenAIConfig(base_url="http://127.0.0.1:9/v1", model="legacy", dimensions=8),
        rate_requests_per_second=1.0,
        guard_refresh_seconds=0,
    )
    store = PgProviderStateStore(pool)
    guard = build_guard(settings, store, "w-edges")
    await guard.before_request(tokens=1, purpose=Purpose.INDEX, owner="w-edges")  # buckets
    # What a process without the cap left behind: a year's pause, its buckets owing it.
    await store.pause(guard.provider, seconds=A_YEAR, plan=quota_plan(settings))
    assert await pool.fetchval(
        "SELECT min(tat) > now() + interval '300 days' FROM embedding_quota_bucket"
        " WHERE provider = $1",
        guard.provider,
    )
    allowance = await guard.claim_allowance("w-edges")
    assert allowance.reason == "paused"
    assert allowance.retry_in_seconds is not None
    assert allowance.retry_in_seconds <= 300
    paused_for = await pool.fetchval(
        "SELECT extract(epoch FROM paused_until - now()) FROM embedding_provider_state"
        " WHERE provider = $1",
        guard.provider,
    )
    owed_for = await pool.fetchval(
        "SELECT extract(epoch FROM max(tat) - now()) FROM embedding_quota_bucket"
        " WHERE provider = $1",
        guard.provider,
    )
    assert paused_for <= 300
    assert owed_for <= 300 + 60  # the pause and at most a burst's tolerance after it


async def _statuses(pool: asyncpg.Pool[Any], *task_ids: uuid.UUID) -> list[str]:
    rows = await pool.fetch(
        "SELECT task_id, status FROM index_task WHERE task_id = ANY($1::uuid[])", list(task_ids)
    )
    by_id = {row["task_id"]: row["status"] for row in rows}
    return [by_id[task_id] for task_id in task_ids]


async def test_a_retire_meeting_a_committing_backfill_waits_for_it(
    pool: asyncpg.Pool[Any],
) -> None:
    await register_default(pool)
    doc = await add_document(pool, "acme")
    retired = await new_generation(pool, ["acme"])  # the tenant's backfill is enqueued
    queue = PgTaskQueue(pool)
    (lease,) = await queue.claim("standard", "w1", lease_seconds=60, limit=1)
    assert lease.generation_id == retired
    sink = PgVectorSink(pool)
    generation = IndexGeneration(NEW_MODEL, 4, NEW_STRATEGY)
    await sink.ensure_generation(generation)
    chunks = versions.make_chunks(doc.document_id, 1, ["the backfilled text"], NEW_STRATEGY)
    vectors = np.full((len(chunks), 4), 0.5, dtype=np.float32)
    # The completion's fence holds its task row; its write (the tenant's rows next) waits.
    paused = PausedWrite(
        sink.writer(lease, generation, chunks, vectors, search_generation_id=retired),
        before_write=True,
    )
    completing = asyncio.create_task(queue.complete(lease, in_transaction=paused))
    retiring: asyncio.Task[Any] | None = None
    try:
        await paused.reached.wait()
        retiring = asyncio.create_task(PgRetirement(pool).retire(retired))
        await wait_until_blocked_on_a_lock(pool)  # the retire, on the completion's rows
    finally:
        paused.release.set()
        results = await asyncio.gather(
            completing, *([retiring] if retiring else []), return_exceptions=True
        )
    completed, outcome = results
    assert completed is None, completed
    assert not isinstance(outcome, BaseException), outcome
    # The completion committed first; the retire found the task finished and went on.
    assert outcome.tasks_ended == 0
    state = await pool.fetchval(
        "SELECT state FROM search_generation WHERE generation_id = $1", retired
    )
    assert state == "RETIRED"


async def test_an_indexer_with_another_model_refuses_while_tenants_search_the_default(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)  # hashing-v1-3
    await add_document(pool, "acme")  # searched through the default: no generation of its own
    await add_document(pool, "globex")
    embedder = HashingEmbedder(dimension=8)  # KB_EMBEDDING_* now names hashing-v1-8
    generation = index_generation(embedder, chunking_strategy(embedder, max_tokens=256))
    sink = PgVectorSink(pool)
    with pytest.raises(ConfigError) as caught:
        await sink.register_default(generation, chunk_max_tokens=256, chunk_overlap_tokens=0)
    message = str(caught.value)
    assert exit_code(caught.value) == 2
    for named in (OLD_MODEL, "hashing-v1-8", "2 tenants", "acme", "globex"):
        assert named in message
    assert "kb index generations create" in message
    assert "kb index generations switch" in message
    defaults = await pool.fetch("SELECT generation_id FROM search_generation WHERE is_default")
    assert [row["generation_id"] for row in defaults] == [default]
    assert await pool.fetchval("SELECT count(*) FROM search_generation") == 1
    # Once every tenant with documents has a generation of its own (`create` pins it to
    # the default), the new default moves nobody's search: the start goes ahead.
    await new_generation(pool, ["acme", "globex"])
    registered = await sink.register_default(
        generation, chunk_max_tokens=256, chunk_overlap_tokens=0
    )
    assert registered.embedding_model == "hashing-v1-8"
    assert registered.is_default
