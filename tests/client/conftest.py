"""The client's tests run against the real server: the composed app of `kb serve`
(services/app.py) served by uvicorn on a real socket, over a test database on the embedded
PostgreSQL, with the hashing embedder; and the real indexer (queue, pipeline, sink), run in
the test's loop as `kb indexer run` runs it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.settings import EmbeddingSettings, HashingConfig
from services.indexer.queue.attempt import RunOnceResult
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import Worker
from services.indexer.retry import RetryPolicy
from services.publisher.settings import PublisherSettings
from services.runtime.pg.db import create_pool
from services.runtime.settings import RuntimeSettings
from services.search.statements import SearchSettings
from tests.support.api import UNTHROTTLED, ApiTenant, add_tenant, live_app
from tests.support.pipeline import running_pipeline

DIMENSION = 64
# `kb indexer run`'s poll, shortened: the worker finds a new task this often.
POLL_SECONDS = 0.05


def embedding_settings() -> EmbeddingSettings:
    return EmbeddingSettings(provider=HashingConfig(kind="hashing", dimensions=DIMENSION))


@contextlib.contextmanager
def serving(database_url: str, **app_options: Any) -> Iterator[str]:
    """The composed app as `kb serve` runs it, on a free port: its base URL."""
    settings = PublisherSettings(database_url=database_url)
    options: dict[str, Any] = {
        "search_settings": SearchSettings(database_url=database_url),
        "embedding_settings": embedding_settings(),
        "auth_settings": UNTHROTTLED,
        **app_options,
    }
    with live_app(create_app(settings, **options), settings) as url:
        yield url


@contextlib.asynccontextmanager
async def indexing(database_url: str) -> AsyncIterator[None]:
    """The indexer working the standard tier's queue until the block ends."""
    pool = await create_pool(RuntimeSettings(database_url=database_url))
    stop = asyncio.Event()
    try:
        async with running_pipeline(pool, embedder=HashingEmbedder(DIMENSION)) as indexer:
            worker = Worker(
                PgTaskQueue(pool),
                indexer,
                tier="standard",
                owner=f"client-tests-{uuid.uuid4().hex[:6]}",
                policy=RetryPolicy(jitter=0),
            )

            async def work() -> None:
                while not stop.is_set():
                    if await worker.run_once() is RunOnceResult.IDLE:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), POLL_SECONDS)

            task = asyncio.create_task(work())
            try:
                yield
            finally:
                stop.set()
                await task
    finally:
        await pool.close()


@pytest.fixture(scope="module")
def server(module_database: str) -> Iterator[str]:
    with serving(module_database) as url:
        yield url


@pytest.fixture(scope="module")
async def indexer(module_database: str) -> AsyncIterator[None]:
    async with indexing(module_database):
        yield


@pytest.fixture
async def tenant(module_database: str, integration_only: None) -> ApiTenant:
    conn = await asyncpg.connect(module_database)
    try:
        return await add_tenant(conn)
    finally:
        await conn.close()
