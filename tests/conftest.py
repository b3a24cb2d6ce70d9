from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from services.runtime.db import create_pool
from services.runtime.settings import RuntimeSettings
from tests.support.stack import (
    Stack,
    create_test_database,
    drop_test_database,
    ensure_template,
    running_stack,
)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    with running_stack() as running:
        yield running


@pytest.fixture(scope="session")
async def template_database(stack: Stack) -> str:
    return await ensure_template(stack)


@pytest.fixture
async def database_url(stack: Stack, template_database: str) -> AsyncIterator[str]:
    """A fresh, migrated database of this test's own."""
    name = await create_test_database(stack, template_database)
    try:
        yield stack.database_url(name)
    finally:
        await drop_test_database(stack, name)


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
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()
