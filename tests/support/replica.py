"""A streaming replica for the tests that search on one (tests/integration/test_search_replicas.py).

When the tests run on the dev stack's embedded PostgreSQL (no ``DATABASE_URL``: CI, and
``scripts/test`` on a laptop), the replica is the dev stack's own replica 1 of it
(``kb dev up --replicas 1``), started here if it does not run and stopped at the end if it
was. When ``DATABASE_URL`` names another server, which we may not be allowed to replicate,
the tests start a primary and a replica of their own: in ``KB_TEST_REPLICA_HOME`` (default
``.kb/test-replica``) on ``KB_TEST_REPLICA_PORT`` and the port after it (default: free
ports), stopped at the end. A server that cannot start fails the tests; they never skip.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from kbtools.devstack.postgres import EmbeddedPostgres
from kbtools.devstack.replicas import EmbeddedReplica
from kbtools.devstack.replicas import caught_up as replica_caught_up
from kbtools.devstack.settings import DevStackSettings
from services.search.connections import open_search_pool
from services.search.replicas import ReplicaRotation
from services.search.statements import SearchSettings
from tests.support.stack import (
    REPO_ROOT,
    Stack,
    create_test_database,
    drop_test_database,
    ensure_template,
)

# The name the tests give their one replica in a rotation.
REPLICA = "replica"


@dataclass(frozen=True)
class ReplicaPair:
    primary: Stack  # the primary, as a Stack: test databases are created on it
    replica_admin_url: str

    def replica_url(self, database_url: str) -> str:
        """The replica's URL of a database of the primary."""
        base, _, _ = self.replica_admin_url.rpartition("/")
        return f"{base}/{database_url.rpartition('/')[2]}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def running_replica(stack: Stack) -> Iterator[ReplicaPair]:
    started: list[EmbeddedPostgres] = []
    if stack.dev_settings is not None:
        primary_stack = stack
        replica = EmbeddedReplica(stack.dev_settings, 1)
    else:
        port = int(os.environ.get("KB_TEST_REPLICA_PORT") or _free_port())
        home = Path(os.environ.get("KB_TEST_REPLICA_HOME") or REPO_ROOT / ".kb" / "test-replica")
        settings = DevStackSettings(home=home, pg_port=port, pg_replica_port=port + 1)
        primary = EmbeddedPostgres(settings)
        if not primary.status().running:
            started.append(primary)
        primary_stack = Stack(primary.up().url or "", stack.kafka_bootstrap)
        replica = EmbeddedReplica(settings, 1)
    try:
        if not replica.status().running:
            started.append(replica)
        url = replica.up().url
        assert url
        # A run killed while a test held replay paused leaves a running replica paused: its
        # databases would never appear. Pausing is a test's own step, never a starting state.
        _resume_replay(url)
        yield ReplicaPair(primary_stack, url)
    finally:
        if os.environ.get("KB_TEST_KEEP_STACK") != "1":
            for server in reversed(started):
                server.down()


def _resume_replay(replica_url: str) -> None:
    async def resume() -> None:
        conn = await asyncpg.connect(replica_url)
        try:
            await conn.execute("SELECT pg_wal_replay_resume()")
        finally:
            await conn.close()

    asyncio.run(resume())


# Replay may wait for a standby query it conflicts with for up to max_standby_streaming_delay
# (30 s by default) before it cancels it, and a freshly started standby's first feedback to
# the primary takes up to wal_receiver_status_interval (10 s): a bound past both, so a
# loaded machine's stall is not taken for a replica that never catches up.
CAUGHT_UP_SECONDS = 60.0


async def caught_up(
    primary_url: str, replica_url: str, timeout_s: float = CAUGHT_UP_SECONDS
) -> None:
    """Returns once the replica has replayed what the primary had written when called."""
    await replica_caught_up(primary_url, replica_url, timeout_s=timeout_s)


@asynccontextmanager
async def replica_database(pair: ReplicaPair) -> AsyncIterator[str]:
    """A database of its own on the primary (a module's: creating one takes seconds here),
    dropped at the end."""
    template = await ensure_template(pair.primary)
    name = await create_test_database(pair.primary, template)
    try:
        yield pair.primary.database_url(name)
    finally:
        await drop_test_database(pair.primary, name)


@asynccontextmanager
async def caught_up_urls(
    pair: ReplicaPair, database: str, timeout_s: float = CAUGHT_UP_SECONDS
) -> AsyncIterator[tuple[str, str]]:
    """The database on the primary and on the replica, the replica caught up; its replay is
    resumed at the end, so no test leaves it paused for the next."""
    replica_url = pair.replica_url(database)
    await caught_up(database, replica_url, timeout_s=timeout_s)
    try:
        yield database, replica_url
    finally:
        replica = await asyncpg.connect(replica_url)
        try:
            await replica.execute("SELECT pg_wal_replay_resume()")
        finally:
            await replica.close()


@asynccontextmanager
async def search_pools(primary_url: str, replica_url: str) -> AsyncIterator[tuple[Any, Any]]:
    """Search pools on the primary and on the replica."""
    primary = await open_search_pool(SearchSettings(database_url=primary_url))
    try:
        replica = await open_search_pool(SearchSettings(database_url=replica_url))
        try:
            yield primary, replica
        finally:
            await replica.close()
    finally:
        await primary.close()


def one_replica_rotation(
    primary: Any,
    replica: Any,
    *,
    after_wait_seconds: float,
    max_lag_seconds: float = 3600,
    check_seconds: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
) -> ReplicaRotation:
    """A rotation of the one replica; by default its lag limit is one nobody reaches, so a
    paused replica stays in it."""
    return ReplicaRotation(
        primary,
        [(REPLICA, replica)],
        max_lag_seconds=max_lag_seconds,
        after_wait_seconds=after_wait_seconds,
        check_seconds=check_seconds,
        clock=clock,
    )
