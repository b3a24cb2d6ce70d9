from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import asyncpg
import pytest

from services.runtime.pg.db import create_pool
from services.runtime.settings import RuntimeSettings
from tests.support.replica import (
    ReplicaPair,
    caught_up_urls,
    running_replica,
    search_pools,
)
from tests.support.replica import replica_database as replica_database_of
from tests.support.stack import (
    DatabaseSupply,
    Stack,
    connected,
    create_test_database,
    drop_test_database,
    ensure_template,
    running_stack,
)

# --- the servers are for tests marked `integration` ------------------------------------------
# `scripts/test --unit` deselects `integration` (and `e2e`) and must start no server, so a test
# that reaches PostgreSQL or Kafka without the mark is an error, not a silent server start.

INTEGRATION = "integration"
# Every other server fixture (database_url, settings, service_env, pool, conn, ...) depends on
# one of these, so they are in the fixture closure of any test that statically uses a server.
SERVER_FIXTURES = frozenset({"stack", "template_database"})


def server_fixtures_of(item: pytest.Item) -> list[str]:
    return sorted(SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())))


class Node(Protocol):  # a test item, or the node of a function-scoped fixture's request
    @property
    def nodeid(self) -> str: ...

    def get_closest_marker(self, name: str) -> pytest.Mark | None: ...


def require_integration_mark(node: Node, what: str) -> None:
    if node.get_closest_marker(INTEGRATION) is None:
        pytest.fail(
            f"{node.nodeid} uses {what} (the real PostgreSQL/Kafka) but is not marked"
            f" `{INTEGRATION}`: add `pytestmark = pytest.mark.{INTEGRATION}` to its module,"
            f" or `marks=pytest.mark.{INTEGRATION}` to the param that needs the servers",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # An e2e test that uses the servers is an integration test as well: `-m integration`
    # selects it and `-m "not integration"` leaves it out, like any other server test.
    for item in items:
        if item.get_closest_marker("e2e") is not None and server_fixtures_of(item):
            item.add_marker(INTEGRATION)


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up, so no server starts
def pytest_runtest_setup(item: pytest.Item) -> None:
    used = server_fixtures_of(item)
    if used:
        require_integration_mark(item, "fixture " + ", ".join(used))


@pytest.fixture
def integration_only(request: pytest.FixtureRequest) -> None:
    """The first argument of `database_url`, which every function-scoped server fixture goes
    through: a test that requests one of them with ``request.getfixturevalue`` (invisible to
    the check above) fails here, before the servers are started for it."""
    require_integration_mark(request.node, "a server fixture")


# --- the servers ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    with running_stack() as running:
        yield running


@pytest.fixture(scope="session")
def replica_pair(stack: Stack) -> Iterator[ReplicaPair]:
    """A streaming replica of the test primary, one per session: every module that searches
    on a replica shares it (two would start two servers on one data directory)."""
    with running_replica(stack) as pair:
        yield pair


@pytest.fixture(scope="module")
async def replica_database(replica_pair: ReplicaPair) -> AsyncIterator[str]:
    """One database on the replicated primary for a module's tests (creating one takes
    seconds here); each test has tenants of its own in it."""
    async with replica_database_of(replica_pair) as url:
        yield url


@pytest.fixture
async def replica_urls(
    integration_only: None, replica_pair: ReplicaPair, replica_database: str
) -> AsyncIterator[tuple[str, str]]:
    """The module's replicated database on the primary and on the replica, the replica
    caught up (one just started may first replay what the primary wrote while it was down),
    its replay resumed after the test."""
    async with caught_up_urls(replica_pair, replica_database, timeout_s=300) as urls:
        yield urls


@pytest.fixture
async def replica_pools(replica_urls: tuple[str, str]) -> AsyncIterator[tuple[Any, Any]]:
    """Search pools on the primary and on the replica."""
    async with search_pools(*replica_urls) as pools:
        yield pools


@pytest.fixture(scope="session")
async def template_database(stack: Stack) -> str:
    return await ensure_template(stack)


@pytest.fixture(scope="session")
async def database_supply(stack: Stack, template_database: str) -> AsyncIterator[DatabaseSupply]:
    supply = DatabaseSupply(stack, template_database)
    try:
        yield supply
    finally:
        await supply.close()


@pytest.fixture(scope="module")
async def module_database(stack: Stack, template_database: str) -> AsyncIterator[str]:
    """A migrated database shared by the tests of one module (the client and security
    suites': their many small requests share the set-up)."""
    name = await create_test_database(stack, template_database)
    try:
        yield stack.database_url(name)
    finally:
        await drop_test_database(stack, name)


@pytest.fixture
async def database_url(
    integration_only: None, stack: Stack, database_supply: DatabaseSupply
) -> AsyncIterator[str]:
    """A fresh, migrated database of this test's own (cloned while the previous test ran)."""
    name = await database_supply.take()
    try:
        yield stack.database_url(name)
    finally:
        database_supply.give_back(name)


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def settings(database_url: str, stack: Stack, topic_prefix: str) -> RuntimeSettings:
    return RuntimeSettings(
        database_url=database_url,
        kafka_bootstrap_servers=stack.kafka_bootstrap,
        kafka_topic_prefix=topic_prefix,
    )


@pytest.fixture
def service_env(settings: RuntimeSettings) -> dict[str, str]:
    """The environment a `kb` process started by a test runs with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(
        DATABASE_URL=settings.database_url,
        KAFKA_BOOTSTRAP_SERVERS=settings.kafka_bootstrap_servers,
        KB_KAFKA_TOPIC_PREFIX=settings.kafka_topic_prefix,
    )
    return env


@pytest.fixture
async def pool(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    db_pool = await create_pool(settings)
    try:
        yield db_pool
    finally:
        await db_pool.close()


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    async with connected(database_url) as connection:
        yield connection
