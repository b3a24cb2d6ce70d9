"""Long-running processes survive PostgreSQL's restarts (RELIABILITY.md, "exited on
PostgreSQL's restart").

The server is one of the test's own (tests/support/restartable_pg.py), restarted with a
fast shutdown ("terminating connection due to administrator command"). `kb indexer run`
meets it at start (the server down; a start-up statement cut off: the chaos runs' exit),
idle, while it claims and indexes, and while its pools still fail to restore their
connection floor; `kb relay run` while it waits on its LISTEN; `kb ingest run` and
`kb serve` at start.
After each restart the process must still run and index (or relay) what is published
after it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import asyncpg
import httpx
import pytest

from services.relay.settings import RelaySettings
from tests.support.api import free_port
from tests.support.embedding_provider import ServedProvider, served_provider
from tests.support.kafka import TopicReader, publish, relay_topics
from tests.support.restartable_pg import RestartablePostgres, restartable_postgres
from tests.support.stack import (
    REPO_ROOT,
    Stack,
    create_test_database,
    drop_test_database,
    ensure_template,
)
from tests.support.tasks import CreatedTask, create_many_tasks, create_task

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]
WAIT = 120.0
FLOOR_NOT_RESTORED = "Failed to restore the pool connection floor"


@pytest.fixture(scope="module")
def own_postgres(stack: Stack) -> Iterator[RestartablePostgres]:
    with restartable_postgres(stack.kafka_bootstrap) as server:
        yield server


@pytest.fixture
async def restart_database(
    integration_only: None, own_postgres: RestartablePostgres
) -> AsyncIterator[str]:
    server = own_postgres.stack
    name = await create_test_database(server, await ensure_template(server))
    try:
        yield server.database_url(name)
    finally:
        await drop_test_database(server, name)


class Running:
    """A `kb` process whose stderr (JSON log lines) is read all along, so the test can wait
    for a line and the child never blocks on a full pipe."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._ended = False  # its stderr closed: it exited
        self._new_line = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stderr is not None
        while raw := await self.process.stderr.readline():
            async with self._new_line:
                self.lines.append(raw.decode(errors="replace"))
                self._new_line.notify_all()
        async with self._new_line:
            self._ended = True
            self._new_line.notify_all()

    def alive(self) -> bool:
        return self.process.returncode is None and not self._ended

    def tail(self) -> str:
        return "".join(self.lines[-30:])

    async def wait_for(self, text: str, *, after: int) -> int:
        """Index of the first line from ``after`` on that contains ``text``."""
        async with asyncio.timeout(WAIT), self._new_line:
            while True:
                for index in range(after, len(self.lines)):
                    if text in self.lines[index]:
                        return index
                if self._ended:
                    raise AssertionError(f"exited before {text!r}:\n{self.tail()}")
                await self._new_line.wait()

    async def close(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()
        await self._reader


@pytest.fixture(scope="module")
def provider() -> Iterator[ServedProvider]:
    with served_provider() as served:
        served.provider.inject("delay", delay_seconds=0.3)
        yield served


StartKb = Callable[..., Awaitable[Running]]
Start = Callable[[], Awaitable[Running]]


@pytest.fixture
async def start_kb(
    restart_database: str, stack: Stack, topic_prefix: str
) -> AsyncIterator[StartKb]:
    """Starts a `kb` command on the test's server (its JSON log read along), killed at the
    end."""
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KB_")},
        "DATABASE_URL": restart_database,
        "KAFKA_BOOTSTRAP_SERVERS": stack.kafka_bootstrap,
        "KB_KAFKA_TOPIC_PREFIX": topic_prefix,
        "KB_LOG_FORMAT": "json",
    }
    started: list[Running] = []

    async def start(*args: str, **env: str) -> Running:
        process = await asyncio.create_subprocess_exec(
            *KB,
            *args,
            env={**base, **env},
            cwd=REPO_ROOT,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        started.append(Running(process))
        return started[-1]

    try:
        yield start
    finally:
        for running in started:
            await running.close()


@pytest.fixture
def start_indexer(start_kb: StartKb, provider: ServedProvider) -> Start:
    """Starts `kb indexer run` with a remote embedding provider (its guard keeps state in
    the database too) and short timers, so every loop meets the restarts."""

    async def start() -> Running:
        return await start_kb(
            *("indexer", "run", "--tier", "standard", "--concurrency", "4"),
            KB_EMBEDDING_PROVIDER="openai",
            KB_EMBEDDING_BASE_URL=provider.base_url,
            KB_EMBEDDING_MODEL="hashing-v1-384",
            KB_EMBEDDING_DIMENSIONS="384",
            KB_EMBEDDING_TIMEOUT_SECONDS="2",
            KB_INDEXER_POLL_SECONDS="0.5",
            KB_INDEXER_LEASE_SECONDS="6",
            KB_INDEXER_METRICS_INTERVAL_SECONDS="0.5",
            KB_INDEX_GC_INTERVAL_SECONDS="0.5",
            KB_RETENTION_INTERVAL_SECONDS="0.5",
            KB_INDEXER_TENANT_GRAPH_CHECK_SECONDS="0.5",
        )

    return start


async def _status(database_url: str, task: CreatedTask) -> str | None:
    try:
        conn = await asyncpg.connect(database_url)
    except (OSError, asyncpg.PostgresError):
        return None  # the server still starting
    try:
        status: str | None = await conn.fetchval(
            "SELECT status FROM index_task WHERE task_id = $1", task.task_id
        )
        return status
    finally:
        await conn.close()


async def _published_and_indexed(database_url: str, indexer: Running) -> None:
    """A document published now is indexed by the running process."""
    conn = await asyncpg.connect(database_url)
    try:
        task = await create_task(conn, tenant_id=f"t{uuid.uuid4().hex[:8]}")
    finally:
        await conn.close()
    async with asyncio.timeout(WAIT):
        while (status := await _status(database_url, task)) != "SUCCEEDED":
            assert status != "DEAD", f"the task died:\n{indexer.tail()}"
            assert indexer.alive(), f"the indexer exited:\n{indexer.tail()}"
            await asyncio.sleep(0.2)
    assert indexer.alive(), indexer.tail()


async def _restart(server: RestartablePostgres) -> None:
    await asyncio.to_thread(server.restart)


async def _stopped_while_waiting(
    server: RestartablePostgres, start: Start, process: str
) -> tuple[Running, int]:
    """``start``'s process, started while the database is down, SIGTERMed once it says it
    waits: the process and its exit code, after its ``<process>.stopped_at_start`` line."""
    await asyncio.to_thread(server.stop)
    try:
        running = await start()
        await running.wait_for('"database.unavailable"', after=0)
        running.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT):
            code = await running.process.wait()
        await running.wait_for(f'"{process}.stopped_at_start"', after=0)
    finally:
        await asyncio.to_thread(server.start)
    return running, code


async def test_an_indexer_waits_for_postgres_at_start(
    own_postgres: RestartablePostgres, restart_database: str, start_indexer: Start
) -> None:
    """Started while the server is down, it waits (``database.unavailable``) instead of
    exiting, and works once the server is up."""
    await asyncio.to_thread(own_postgres.stop)
    try:
        indexer = await start_indexer()
        await indexer.wait_for('"database.unavailable"', after=0)
    finally:
        await asyncio.to_thread(own_postgres.start)
    await _published_and_indexed(restart_database, indexer)


async def test_sigterm_ends_the_wait_at_start(
    own_postgres: RestartablePostgres, restart_database: str, start_indexer: Start
) -> None:
    """An orchestrator stopping an indexer that still waits for the database: a clean exit
    (0), nothing started."""
    indexer, code = await _stopped_while_waiting(own_postgres, start_indexer, "indexer")
    assert code == 0, indexer.tail()


async def test_a_restart_during_the_start_is_waited_through(
    own_postgres: RestartablePostgres, restart_database: str, start_indexer: Start
) -> None:
    """The chaos runs' exit: the pool open, a start-up statement running, the server shut
    down. Here the start's statement waits behind the test's open transaction (holding the
    lock of the default generation's registration; the index build waits for it too) when
    the server restarts."""
    holder = await asyncpg.connect(restart_database)
    transaction = holder.transaction()
    await transaction.start()
    await holder.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('kb.search_generation', 0))"
    )
    indexer = await start_indexer()
    async with asyncio.timeout(WAIT):
        while not await holder.fetchval(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND pid <> pg_backend_pid()"
        ):
            assert indexer.alive(), indexer.tail()
            await asyncio.sleep(0.1)
    await _restart(own_postgres)  # ends the holder's session as well as the indexer's
    await indexer.wait_for('"database.unavailable"', after=0)
    await _published_and_indexed(restart_database, indexer)


async def test_a_running_indexer_survives_postgres_restarts(
    own_postgres: RestartablePostgres, restart_database: str, start_indexer: Start
) -> None:
    indexer = await start_indexer()
    await _published_and_indexed(restart_database, indexer)

    # While idle: nothing claimed, only the loops' own statements (polls, samplers, GC).
    await _restart(own_postgres)
    await _published_and_indexed(restart_database, indexer)

    # While it claims and indexes: a backlog, the restart at the first claim of it.
    seen = len(indexer.lines)
    conn = await asyncpg.connect(restart_database)
    try:
        await create_many_tasks(conn, 200, tenant_id="backlog")
    finally:
        await conn.close()
    await indexer.wait_for('"task.claimed"', after=seen)
    await _restart(own_postgres)
    await _published_and_indexed(restart_database, indexer)

    # Down long enough for the pools to fail restoring their floor, then up (the chaos
    # runs' exit), twice.
    for _ in range(2):
        seen = len(indexer.lines)
        await asyncio.to_thread(own_postgres.stop)
        await indexer.wait_for(FLOOR_NOT_RESTORED, after=seen)
        await asyncio.to_thread(own_postgres.start)
        await _published_and_indexed(restart_database, indexer)

    assert indexer.alive(), indexer.tail()


async def _published_and_relayed(database_url: str, reader: TopicReader, relay: Running) -> None:
    """An event committed now reaches Kafka through the running relay."""
    conn = await asyncpg.connect(database_url)
    try:
        event = await publish(conn)
    finally:
        await conn.close()
    await reader.read_event_ids([event.event_id], timeout_s=WAIT)
    assert relay.alive(), relay.tail()


async def test_a_running_relay_survives_postgres_restarts(
    own_postgres: RestartablePostgres,
    restart_database: str,
    stack: Stack,
    topic_prefix: str,
    start_kb: StartKb,
) -> None:
    """The relay LISTENs on a connection of its own: a restart while it waits on it, and a
    server down until its LISTEN cannot come back, then up."""
    relay = await start_kb(
        "relay",
        "run",
        KB_RELAY_PARTITIONS="1",
        KB_RELAY_LEASE_SECONDS="2",
        KB_RELAY_SEND_TIMEOUT_SECONDS="1.0",
        KB_RELAY_POLL_INTERVAL_SECONDS="0.3",
        KB_RELAY_BACKOFF_MAX_SECONDS="0.5",
    )
    topics = relay_topics(RelaySettings(kafka_topic_prefix=topic_prefix))
    async with TopicReader(stack.kafka_bootstrap, topics) as reader:
        await _published_and_relayed(restart_database, reader, relay)
        await _restart(own_postgres)
        await _published_and_relayed(restart_database, reader, relay)
        seen = len(relay.lines)
        await asyncio.to_thread(own_postgres.stop)
        try:
            await relay.wait_for('"relay.listen_failed"', after=seen)
        finally:
            await asyncio.to_thread(own_postgres.start)
        await _published_and_relayed(restart_database, reader, relay)
    assert relay.alive(), relay.tail()


async def test_a_relay_waits_for_postgres_at_start(
    own_postgres: RestartablePostgres,
    restart_database: str,
    stack: Stack,
    topic_prefix: str,
    start_kb: StartKb,
) -> None:
    """`kb relay run` started while the server is down waits for it, logging what every
    long-running command logs then (``database.unavailable``), and relays once it is up."""
    await asyncio.to_thread(own_postgres.stop)
    try:
        relay = await start_kb("relay", "run", KB_RELAY_PARTITIONS="1")
        await relay.wait_for('"database.unavailable"', after=0)
        assert relay.alive(), relay.tail()
    finally:
        await asyncio.to_thread(own_postgres.start)
    topics = relay_topics(RelaySettings(kafka_topic_prefix=topic_prefix))
    async with TopicReader(stack.kafka_bootstrap, topics) as reader:
        await _published_and_relayed(restart_database, reader, relay)


async def test_an_ingest_consumer_waits_for_postgres_at_start(
    own_postgres: RestartablePostgres, start_kb: StartKb
) -> None:
    """`kb ingest run` started while the server is down waits for it, as the indexer does,
    and starts consuming once it is up."""
    await asyncio.to_thread(own_postgres.stop)
    try:
        consumer = await start_kb("ingest", "run", "--tier", "standard")
        await consumer.wait_for('"database.unavailable"', after=0)
        assert consumer.alive(), consumer.tail()
    finally:
        await asyncio.to_thread(own_postgres.start)
    await consumer.wait_for('"ingest.started"', after=0)
    assert consumer.alive(), consumer.tail()


async def _answer(port: int, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        return await client.get(path)


async def _until_ready(port: int, server: Running) -> None:
    async with asyncio.timeout(WAIT):
        while (await _answer(port, "/readyz")).status_code != 200:
            assert server.alive(), server.tail()
            await asyncio.sleep(0.2)


async def test_an_api_waits_for_postgres_at_start(
    own_postgres: RestartablePostgres, start_kb: StartKb
) -> None:
    """`kb serve` started while the server is down listens and waits: alive (/healthz 200),
    not ready (/readyz 503), a request refused with 503 DATABASE_UNAVAILABLE and a
    Retry-After; ready once the server is up."""
    port = free_port()
    await asyncio.to_thread(own_postgres.stop)
    try:
        server = await start_kb("serve", "--port", str(port))
        await server.wait_for('"database.unavailable"', after=0)
        assert (await _answer(port, "/healthz")).status_code == 200, server.tail()
        assert (await _answer(port, "/readyz")).status_code == 503
        refused = await _answer(port, "/v1/tenants/t1/documents/d1")
        assert refused.status_code == 503
        assert refused.json()["errorCode"] == "DATABASE_UNAVAILABLE"
        assert refused.headers["Retry-After"]
    finally:
        await asyncio.to_thread(own_postgres.start)
    await _until_ready(port, server)
    await server.wait_for('"serve.ready"', after=0)
    unknown_key = await _answer(port, "/v1/tenants/t1/documents/d1")
    assert unknown_key.status_code == 401, unknown_key.text  # the app itself answers now
    assert server.alive(), server.tail()


async def test_sigterm_ends_an_api_waiting_at_start(
    own_postgres: RestartablePostgres, start_kb: StartKb
) -> None:
    """An orchestrator stopping `kb serve` that still waits for the database: exit 0."""
    server, code = await _stopped_while_waiting(
        own_postgres, lambda: start_kb("serve", "--port", str(free_port())), "serve"
    )
    assert code == 0, server.tail()
