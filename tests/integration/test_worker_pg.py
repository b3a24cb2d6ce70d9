"""run_once against PostgreSQL, with small indexers standing in for the pipeline (the
pipeline itself: tests/integration/test_pipeline_pg.py)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.indexer.ports import IndexingOutcome, Transaction
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker, WorkerEvent
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, IndexingFailed, Lease, TaskStatus
from services.runtime.pg.db import create_pool, translate_db_errors
from services.runtime.settings import RuntimeSettings
from tests.support.clock import ManualClock
from tests.support.hanging_worker import HangingIndexer
from tests.support.pg_proxy import CommitDroppingProxy
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration


class Succeeds:
    async def index(self, lease: Lease) -> IndexingOutcome:
        return IndexingOutcome()


def worker(pool: asyncpg.Pool[Any], **options: Any) -> Worker:
    return Worker(
        PgTaskQueue(pool),
        options.pop("indexer", None) or Succeeds(),
        tier="standard",
        owner="it-worker",
        policy=RetryPolicy(jitter=0),
        **options,
    )


async def _status(pool: asyncpg.Pool[Any], task_id: uuid.UUID) -> tuple[str, str | None]:
    row = await pool.fetchrow(
        "SELECT status, error_code FROM index_task WHERE task_id = $1", task_id
    )
    assert row is not None
    return row["status"], row["error_code"]


async def test_a_claimed_task_succeeds_and_the_queue_is_then_idle(
    pool: asyncpg.Pool[Any],
) -> None:
    created = await create_task(pool)
    assert await worker(pool).run_once() is RunOnceResult.SUCCEEDED
    assert await _status(pool, created.task_id) == ("SUCCEEDED", None)
    assert await worker(pool).run_once() is RunOnceResult.IDLE


async def test_heartbeat_keeps_the_lease_while_the_work_runs(pool: asyncpg.Pool[Any]) -> None:
    created = await create_task(pool)
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    hanging = HangingIndexer(Succeeds(), hang_generations=1)
    running = asyncio.create_task(
        worker(pool, indexer=hanging, lease_seconds=0.6, signals=signals).run_once()
    )
    beats = 0
    async with asyncio.timeout(10):
        while beats < 3:
            if (await signals.get()).kind == "heartbeat":
                beats += 1
    row = await pool.fetchrow(
        "SELECT status, attempts, lease_until > now() AS live FROM index_task WHERE task_id = $1",
        created.task_id,
    )
    assert row is not None
    assert (row["status"], row["attempts"], row["live"]) == ("RUNNING", 1, True)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert await _status(pool, created.task_id) == (str(TaskStatus.RUNNING), None)


class AlwaysFails:
    def __init__(
        self,
        code: str,
        retry_after_seconds: float | None = None,
        retriable: bool | None = None,
    ) -> None:
        self.code = code
        self.retry_after_seconds = retry_after_seconds
        self.retriable = retriable

    async def index(self, lease: Lease) -> Any:
        raise IndexingFailed(
            self.code,
            "provider says no",
            retry_after_seconds=self.retry_after_seconds,
            retriable=self.retriable,
        )


async def _delay(pool: asyncpg.Pool[Any], task_id: uuid.UUID, now: datetime) -> float:
    due = await pool.fetchval("SELECT next_attempt_at FROM index_task WHERE task_id = $1", task_id)
    return float((due - now).total_seconds())


async def test_retryable_failures_back_off_exponentially_up_to_the_cap_then_die(
    pool: asyncpg.Pool[Any],
) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(pool, max_attempts=6, next_attempt_at=clock.now())
    timing_out = Worker(
        PgTaskQueue(pool, clock=clock),
        # Retriable, but not provider-side: on the attempt budget (provider failures are on
        # a time budget: tests/integration/test_indexer_provider_budget.py).
        AlwaysFails("INDEX_STAGING_INCOMPLETE", retriable=True),
        tier="standard",
        policy=RetryPolicy(backoff_base_seconds=2, backoff_cap_seconds=10, jitter=0),
    )
    delays = []
    for _ in range(5):
        assert await timing_out.run_once() is RunOnceResult.FAILED
        assert await _status(pool, created.task_id) == ("RETRY_WAIT", "INDEX_STAGING_INCOMPLETE")
        delays.append(await _delay(pool, created.task_id, clock.now()))
        clock.advance(delays[-1])
    assert delays == [2, 4, 8, 10, 10]
    assert await timing_out.run_once() is RunOnceResult.FAILED  # the 6th and last attempt
    assert await _status(pool, created.task_id) == ("DEAD", "INDEX_STAGING_INCOMPLETE")
    clock.advance(3600)
    assert await timing_out.run_once() is RunOnceResult.IDLE


async def test_rate_limit_retry_after_is_respected(pool: asyncpg.Pool[Any]) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(pool, next_attempt_at=clock.now())
    limited = Worker(
        PgTaskQueue(pool, clock=clock),
        AlwaysFails(ErrorCode.EMBEDDING_RATE_LIMITED, retry_after_seconds=120),
        tier="standard",
        policy=RetryPolicy(
            backoff_base_seconds=1,
            backoff_cap_seconds=30,
            jitter=0.5,
            max_retry_after_seconds=600,
        ),
    )
    assert await limited.run_once() is RunOnceResult.FAILED
    assert await _delay(pool, created.task_id, clock.now()) == 120
    clock.advance(119)
    assert await limited.run_once() is RunOnceResult.IDLE
    clock.advance(1)
    assert await limited.run_once() is RunOnceResult.FAILED


@pytest.mark.parametrize(
    "code",
    [ErrorCode.DOCUMENT_TOO_LARGE, ErrorCode.EMBEDDING_RESPONSE_INVALID, "SOMETHING_NEW"],
)
async def test_terminal_and_unknown_codes_die_on_the_first_attempt(
    pool: asyncpg.Pool[Any], code: str
) -> None:
    created = await create_task(pool)
    assert await worker(pool, indexer=AlwaysFails(code)).run_once() is RunOnceResult.FAILED
    assert await _status(pool, created.task_id) == ("DEAD", code)


class Recording:
    def __init__(self) -> None:
        self.runs: list[tuple[uuid.UUID, int]] = []

    async def index(self, lease: Lease) -> Any:
        self.runs.append((lease.task_id, lease.lease_attempt))
        await asyncio.sleep(0)  # let the other workers interleave

        async def write(conn: Transaction) -> None:
            # Stands in for the sink: a row written only if the fenced complete commits.
            await conn.execute("SELECT 1")

        return IndexingOutcome(write=write)


async def test_several_workers_drain_a_multi_tenant_queue_each_task_exactly_once(
    pool: asyncpg.Pool[Any],
) -> None:
    created = [await create_task(pool, tenant_id=f"tenant{i % 4}") for i in range(60)]
    recording = Recording()
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    workers = [
        Worker(
            PgTaskQueue(pool),
            recording,
            tier="standard",
            owner=f"worker-{n}",
            concurrency=3,
            poll_interval_seconds=0.05,
            signals=signals,
        )
        for n in range(3)
    ]
    stop = asyncio.Event()
    loops = [asyncio.create_task(w.run(stop)) for w in workers]
    completed = 0
    async with asyncio.timeout(30):
        while completed < len(created):
            if (await signals.get()).kind == "completed":
                completed += 1
    stop.set()
    await asyncio.gather(*loops)

    assert sorted(task_id for task_id, _ in recording.runs) == sorted(c.task_id for c in created)
    assert {attempt for _, attempt in recording.runs} == {1}
    statuses = await pool.fetch("SELECT status, count(*) FROM index_task GROUP BY status")
    assert [(r["status"], r["count"]) for r in statuses] == [("SUCCEEDED", len(created))]


async def _until(
    signals: asyncio.Queue[WorkerEvent],
    kind: str,
    count: int = 1,
    loop: asyncio.Task[None] | None = None,
) -> None:
    """Wait for ``count`` events of ``kind``; if ``loop`` ends first, raise what ended it."""
    seen = 0
    async with asyncio.timeout(15):
        while seen < count:
            getter = asyncio.ensure_future(signals.get())
            waiters: set[asyncio.Future[Any]] = {getter}
            if loop is not None:
                waiters.add(loop)
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                assert loop is not None
                loop.result()  # the worker loop's own error, if it died of one
                raise AssertionError(f"the worker loop ended before {count} {kind!r} events")
            if getter.result().kind == kind:
                seen += 1


class HitsStatementTimeout:
    """An indexer whose own query runs into a (short) statement_timeout."""

    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self.pool = pool

    async def index(self, lease: Lease) -> Any:
        with translate_db_errors():
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute("SET LOCAL statement_timeout = '50ms'")
                await conn.execute("SELECT pg_sleep(10)")


async def test_a_statement_timeout_while_indexing_is_retried_not_dead(
    pool: asyncpg.Pool[Any],
) -> None:
    created = await create_task(pool)
    timing_out = worker(pool, indexer=HitsStatementTimeout(pool))
    assert await timing_out.run_once() is RunOnceResult.FAILED
    assert await _status(pool, created.task_id) == ("RETRY_WAIT", "DATABASE_BUSY")


class WriteHasABug:
    """Indexing succeeds; the sink's write inside complete's transaction writes a row and
    then fails with a programming error."""

    async def index(self, lease: Lease) -> Any:
        async def write(conn: Transaction) -> None:
            await conn.execute(
                "INSERT INTO tenant (tenant_id, tier) VALUES ('written-by-sink', 'standard')"
            )
            raise KeyError("chunk_id")

        return IndexingOutcome(write=write)


async def test_a_bug_in_the_write_inside_complete_is_dead_after_one_attempt(
    pool: asyncpg.Pool[Any],
) -> None:
    created = await create_task(pool)
    assert await worker(pool, indexer=WriteHasABug()).run_once() is RunOnceResult.FAILED
    row = await pool.fetchrow(
        "SELECT status, error_code, error_message, attempts FROM index_task WHERE task_id = $1",
        created.task_id,
    )
    assert row is not None
    assert (row["status"], row["error_code"], row["attempts"]) == ("DEAD", "INTERNAL_ERROR", 1)
    assert "KeyError" in row["error_message"]
    # complete's transaction rolled back: neither SUCCEEDED nor the sink's row.
    assert not await pool.fetchval(
        "SELECT EXISTS (SELECT 1 FROM tenant WHERE tenant_id = 'written-by-sink')"
    )


async def test_claims_blocked_past_the_statement_timeout_do_not_stop_the_worker(
    pool: asyncpg.Pool[Any], settings: RuntimeSettings, database_url: str
) -> None:
    created = await create_task(pool)
    # The worker's pool gives up on any statement after 200 ms.
    short = await create_pool(
        settings, min_size=1, max_size=4, server_settings={"statement_timeout": "200"}
    )
    holder = await asyncpg.connect(database_url)
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    stop = asyncio.Event()
    loop: asyncio.Task[None] | None = None
    try:
        locked = holder.transaction()
        await locked.start()
        await holder.execute("LOCK TABLE index_task IN ACCESS EXCLUSIVE MODE")
        running = worker(short, poll_interval_seconds=0.2, signals=signals)
        loop = asyncio.create_task(running.run(stop))
        # Timed out, backed off, timed out again: the loop is still there.
        await _until(signals, "claim_failed", 2, loop)
        await locked.rollback()  # the lock is gone: the next claim gets the task
        await _until(signals, "completed", 1, loop)
        stop.set()
        await asyncio.wait_for(loop, 15)
    finally:
        stop.set()
        if loop is not None and not loop.done():
            loop.cancel()
        await holder.close()
        await short.close()
    assert await _status(pool, created.task_id) == ("SUCCEEDED", None)


class HangsUntilReleased:
    """Indexes nothing until released; then hands ``complete`` a write into a table."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def index(self, lease: Lease) -> Any:
        self.started.set()
        await self.release.wait()
        return IndexingOutcome()


async def test_heartbeats_hold_the_lease_while_every_pool_connection_is_busy(
    pool: asyncpg.Pool[Any], settings: RuntimeSettings
) -> None:
    # Defect 8: heartbeats shared the claim/result pool; with every connection busy they
    # waited for one and a healthy lease expired. They have a connection of their own now.
    created = await create_task(pool)
    busy = await create_pool(settings, min_size=2, max_size=2)
    beats = await create_pool(settings, min_size=1, max_size=1)
    indexer = HangsUntilReleased()
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    running = asyncio.create_task(
        Worker(
            PgTaskQueue(busy, heartbeat_pool=beats),
            indexer,
            tier="standard",
            owner="it-worker",
            lease_seconds=3.0,
            signals=signals,
        ).run_once()
    )
    held: list[Any] = []
    try:
        async with asyncio.timeout(15):
            await indexer.started.wait()
            held = [await busy.acquire() for _ in range(2)]  # claims and writes: all taken
            beats_seen = 0
            while beats_seen < 3:
                event = await signals.get()
                assert event.kind != "lease_lost", "a heartbeat starved for a connection"
                beats_seen += event.kind == "heartbeat"
        row = await pool.fetchrow(
            "SELECT status, attempts, lease_owner, lease_until > now() AS live "
            "FROM index_task WHERE task_id = $1",
            created.task_id,
        )
        assert row is not None
        assert (row["status"], row["attempts"], row["lease_owner"], row["live"]) == (
            "RUNNING",
            1,
            "it-worker",
            True,
        )
        for connection in held:
            await busy.release(connection)
        held = []
        indexer.release.set()
        assert await asyncio.wait_for(running, 15) is RunOnceResult.SUCCEEDED
    finally:
        for connection in held:
            await busy.release(connection)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await busy.close()
        await beats.close()
    assert await _status(pool, created.task_id) == ("SUCCEEDED", None)


class WritesThen:
    """Indexing succeeds; the sink's write inserts a marker row, then runs ``after``."""

    def __init__(self, after: str | None = None) -> None:
        self.after = after

    async def index(self, lease: Lease) -> Any:
        async def write(conn: Transaction) -> None:
            await conn.execute(
                "INSERT INTO tenant (tenant_id, tier) VALUES ('written-by-sink', 'standard')"
            )
            if self.after is not None:
                await conn.execute(self.after)

        return IndexingOutcome(write=write)


async def _sink_row_exists(pool: asyncpg.Pool[Any]) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT EXISTS (SELECT 1 FROM tenant WHERE tenant_id = 'written-by-sink')"
        )
    )


async def test_a_commit_whose_connection_dropped_after_it_landed_is_succeeded(
    pool: asyncpg.Pool[Any], database_url: str, settings: RuntimeSettings
) -> None:
    # Defect 9: the connection died during COMMIT of complete after the commit landed; the
    # worker called fail, the fence refused it (the task was SUCCEEDED) and it reported
    # LOST_LEASE. It reads the task back now and reports what happened.
    created = await create_task(pool)
    proxy = CommitDroppingProxy(database_url)
    proxied = await create_pool(
        settings.model_copy(update={"database_url": await proxy.start()}),
        min_size=1,
        max_size=2,
    )
    try:
        proxy.arm()
        result = await asyncio.wait_for(worker(proxied, indexer=WritesThen()).run_once(), 15)
        assert proxy.dropped.is_set(), "the proxy never saw the COMMIT"
        assert proxy.commit_tag == b"COMMIT"
    finally:
        await proxied.close()
        await proxy.close()
    assert result is RunOnceResult.SUCCEEDED
    assert await _status(pool, created.task_id) == ("SUCCEEDED", None)
    assert await _sink_row_exists(pool)


async def test_a_connection_killed_inside_the_write_is_retried_and_writes_nothing(
    pool: asyncpg.Pool[Any],
) -> None:
    # The other side of an unknown outcome: the backend is terminated inside complete's
    # transaction, so nothing committed; the task is still ours, and goes the failure path.
    created = await create_task(pool)
    killed = WritesThen(after="SELECT pg_terminate_backend(pg_backend_pid())")
    assert await worker(pool, indexer=killed).run_once() is RunOnceResult.FAILED
    assert await _status(pool, created.task_id) == ("RETRY_WAIT", "DATABASE_UNAVAILABLE")
    assert not await _sink_row_exists(pool)
