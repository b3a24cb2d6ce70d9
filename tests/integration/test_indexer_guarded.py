"""The indexer behind the provider's shared guard, as `kb indexer run` wires it
(services.embedding.guard.factory.guarded): real PostgreSQL, the test provider over HTTP.

- a request waiting for the shared limiter keeps its task's lease alive (heartbeats go on)
  and spends no attempt: a wait several times the lease ends SUCCEEDED on attempt 1;
- while the breaker is open the worker claims nothing (the task stays due, attempts 0);
  once it is due for a probe, one claim goes out as the probe, succeeds and closes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from services.embedding.factory import build_embedder
from services.embedding.guard.breaker import BreakerState
from services.embedding.guard.factory import guarded
from services.embedding.guard.guard import ProviderGuard
from services.embedding.guard.quota import Purpose
from services.embedding.port import Embedder
from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker, WorkerEvent
from services.indexer.task import ErrorCode
from tests.support.embedding_provider import EmbeddingProvider, ServedProvider, served_provider
from tests.support.pipeline import running_pipeline
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

DIMENSION = 32
OWNER = "it-guarded"


@pytest.fixture
def served() -> Iterator[ServedProvider]:
    with served_provider(EmbeddingProvider(dimension=DIMENSION)) as provider:
        yield provider


def guarded_embedder(
    served: ServedProvider, pool: asyncpg.Pool[Any], **settings: Any
) -> tuple[Embedder, ProviderGuard]:
    embedding = EmbeddingSettings(
        provider=OpenAIConfig(base_url=served.base_url, model="guarded", dimensions=DIMENSION),
        **settings,
    )
    embedder, guard = guarded(
        embedding, build_embedder(embedding), pool, purpose=Purpose.INDEX, owner=OWNER
    )
    assert guard is not None
    return embedder, guard


async def status_of(pool: asyncpg.Pool[Any], task_id: Any) -> tuple[str, int]:
    row = await pool.fetchrow("SELECT status, attempts FROM index_task WHERE task_id = $1", task_id)
    assert row is not None
    return row["status"], row["attempts"]


async def test_a_limiter_wait_longer_than_the_lease_keeps_it_and_spends_no_attempt(
    pool: asyncpg.Pool[Any], served: ServedProvider
) -> None:
    # One request every 2 s (a burst of one): the second task's request waits ~2 s, more
    # than three times its 0.6 s lease.
    embedder, guard = guarded_embedder(
        served, pool, rate_requests_per_second=0.5, rate_burst_seconds=1.0, rate_query_reserve=0
    )
    first = await create_task(pool, content=b"The first note about refunds.\n")
    second = await create_task(pool, content=b"The second note about parcels.\n")
    beats: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    async with running_pipeline(pool, embedder=embedder) as indexer:
        worker = Worker(
            PgTaskQueue(pool),
            indexer,
            tier="standard",
            owner=OWNER,
            lease_seconds=0.6,
            gate=guard,
            signals=beats,
        )
        assert await worker.run_once() is RunOnceResult.SUCCEEDED
        began = time.monotonic()
        assert await worker.run_once() is RunOnceResult.SUCCEEDED
        waited = time.monotonic() - began
    assert waited > 1.2  # it did wait for the limiter, past the lease
    heartbeats = []
    while not beats.empty():
        event = beats.get_nowait()
        if event.kind == "heartbeat" and event.task_id == second.task_id:
            heartbeats.append(event)
    assert len(heartbeats) >= 3
    assert await status_of(pool, first.task_id) == ("SUCCEEDED", 1)
    assert await status_of(pool, second.task_id) == ("SUCCEEDED", 1)
    assert len(served.provider.requests) == 2


async def test_an_open_breaker_stops_claims_until_one_probe_closes_it(
    pool: asyncpg.Pool[Any], served: ServedProvider
) -> None:
    embedder, guard = guarded_embedder(
        served,
        pool,
        breaker_failure_threshold=2,
        breaker_open_seconds=0.5,
        breaker_max_open_seconds=0.5,
        guard_refresh_seconds=0,
    )
    for n in range(4):
        await create_task(pool, content=f"Backlog note {n}.\n".encode())
    served.control.inject("status", status=503)  # until cleared
    async with running_pipeline(pool, embedder=embedder) as indexer:
        worker = Worker(PgTaskQueue(pool), indexer, tier="standard", owner=OWNER, gate=guard)
        # The first task's request fails twice over (the batch, then nothing left to split):
        # two failures open the breaker. Run until it is open, claiming one task at a time.
        while (await guard.view()).state is not BreakerState.OPEN:
            assert await worker.run_once() is RunOnceResult.FAILED
        claimed_before = await pool.fetchval("SELECT sum(attempts) FROM index_task")
        # Open: no claim, however often the worker asks; nothing is sent.
        sent = len(served.provider.requests)
        for _ in range(5):
            assert await worker.run_once() is RunOnceResult.IDLE
        assert await pool.fetchval("SELECT sum(attempts) FROM index_task") == claimed_before
        assert len(served.provider.requests) == sent
        served.control.clear_faults()
        # Once the open time is up, one claim probes; its success closes the breaker.
        deadline = time.monotonic() + 10
        result = RunOnceResult.IDLE
        while result is RunOnceResult.IDLE and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the breaker's open time passing, nothing to order
            result = await worker.run_once()
        assert result is RunOnceResult.SUCCEEDED
        assert (await guard.view()).state is BreakerState.CLOSED
        while await worker.run_once() is not RunOnceResult.IDLE:
            pass
    rows = await pool.fetch("SELECT status, error_code, attempts FROM index_task")
    outcomes = sorted((r["status"], r["error_code"], r["attempts"]) for r in rows)
    # The two tasks tried while it was down wait for a retry, with the provider's code and
    # one attempt each; the probe's task and the rest succeeded on their first.
    assert outcomes == [
        *[("RETRY_WAIT", ErrorCode.EMBEDDING_UNAVAILABLE, 1)] * 2,
        *[("SUCCEEDED", None, 1)] * 2,
    ]
