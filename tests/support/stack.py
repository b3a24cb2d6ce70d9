"""The real PostgreSQL and Kafka the tests run against.

``DATABASE_URL`` / ``KAFKA_BOOTSTRAP_SERVERS`` in the environment name external services
(managed, compose, CI-provided); otherwise the project's dev stack (``.kb/dev``) is used,
started here if it is not already running and stopped again at the end if we started it.
A service that cannot start fails the run; it is never skipped.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.postgres import EmbeddedPostgres
from kbtools.devstack.settings import DevStackSettings
from services.runtime.pg.migrations import apply_migrations, load_migrations

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Stack:
    admin_url: str  # a database on the server we may CREATE DATABASE from
    kafka_bootstrap: str
    started: list[EmbeddedPostgres | LocalKafka] = field(default_factory=list)
    # The dev stack's settings when admin_url is its embedded PostgreSQL (no DATABASE_URL):
    # tests/support/replica.py then runs a streaming replica of it.
    dev_settings: DevStackSettings | None = None

    def database_url(self, name: str) -> str:
        base, _, _ = self.admin_url.rpartition("/")
        return f"{base}/{name}"


@contextmanager
def running_stack() -> Iterator[Stack]:
    if os.environ.get("KB_TEST_USE_TESTCONTAINERS") == "1":
        with _testcontainers_stack() as stack:
            yield stack
        return
    settings = DevStackSettings(home=REPO_ROOT / ".kb" / "dev")
    started: list[EmbeddedPostgres | LocalKafka] = []
    admin_url = os.environ.get("DATABASE_URL")
    dev_settings = None if admin_url else settings
    if not admin_url:
        postgres = EmbeddedPostgres(settings)
        if not postgres.status().running:
            started.append(postgres)
        admin_url = postgres.up().url
        assert admin_url
    kafka_bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not kafka_bootstrap:
        kafka = LocalKafka(settings)
        if not kafka.status().running:
            started.append(kafka)
        kafka_bootstrap = kafka.up().url
        assert kafka_bootstrap
    try:
        yield Stack(admin_url, kafka_bootstrap, started, dev_settings)
    finally:
        if os.environ.get("KB_TEST_KEEP_STACK") != "1":
            for service in reversed(started):
                service.down()


def migrations_fingerprint() -> str:
    digest = hashlib.sha256()
    for migration in load_migrations():
        digest.update(f"{migration.version}:{migration.checksum}\n".encode())
    return digest.hexdigest()[:16]


# Any constant shared by concurrent test sessions: they race to build the same template.
_TEMPLATE_LOCK = 0x6B6274706C


async def ensure_template(stack: Stack) -> str:
    """A migrated database to clone each test's database from; one per migration set, so
    test runs on different branches (or concurrent runs) never fight over it."""
    name = f"kbtpl_{migrations_fingerprint()}"
    admin = await asyncpg.connect(stack.admin_url)
    try:
        await admin.execute("SELECT pg_advisory_lock($1)", _TEMPLATE_LOCK)
        try:
            ready = await admin.fetchval(
                "SELECT datistemplate FROM pg_database WHERE datname = $1", name
            )
            if ready:
                return name
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
            conn = await asyncpg.connect(stack.database_url(name))
            try:
                await apply_migrations(conn)
            finally:
                await conn.close()
            # Marked only once complete: a crashed build is rebuilt, never cloned.
            await admin.execute(f'ALTER DATABASE "{name}" WITH IS_TEMPLATE true')
            return name
        finally:
            await admin.execute("SELECT pg_advisory_unlock($1)", _TEMPLATE_LOCK)
    finally:
        await admin.close()


async def create_test_database(stack: Stack, template: str) -> str:
    name = f"kbtest_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(stack.admin_url)
    try:
        # FILE_COPY: for a small template, copying files beats WAL-logging every block.
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}" STRATEGY FILE_COPY')
    finally:
        await admin.close()
    return name


async def drop_test_database(stack: Stack, name: str) -> None:
    admin = await asyncpg.connect(stack.admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


class DatabaseSupply:
    """Test databases cloned from the template one ahead: while a test runs, the server
    already clones the next test's database, and drops the last one's. A clone takes a
    checkpoint and a copy of some hundred files, a good share of a short test's time; done
    ahead it overlaps with the test instead of preceding it. Each database is still used by
    one test only and dropped after it."""

    def __init__(self, stack: Stack, template: str) -> None:
        self._stack = stack
        self._template = template
        self._next: asyncio.Task[str] | None = None
        self._drops: set[asyncio.Task[None]] = set()

    async def take(self) -> str:
        if self._next is None:
            self._next = asyncio.create_task(create_test_database(self._stack, self._template))
        name = await self._next
        self._next = asyncio.create_task(create_test_database(self._stack, self._template))
        return name

    def give_back(self, name: str) -> None:
        drop = asyncio.create_task(drop_test_database(self._stack, name))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)

    async def close(self) -> None:
        if self._next is not None:
            self.give_back(await self._next)
            self._next = None
        await asyncio.gather(*self._drops)


@contextmanager
def _testcontainers_stack() -> Iterator[Stack]:
    """Opt-in for machines with a Docker engine: the same images compose.yaml uses."""
    from testcontainers.community.kafka import KafkaContainer
    from testcontainers.community.postgres import PostgresContainer

    with (
        PostgresContainer("pgvector/pgvector:pg18", driver=None) as postgres,
        KafkaContainer("apache/kafka:4.1.1").with_kraft() as kafka,
    ):
        admin_url = postgres.get_connection_url()
        yield Stack(admin_url, kafka.get_bootstrap_server())


@asynccontextmanager
async def connected(database_url: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    """A connection to the database, closed at the end."""
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()
