"""The sink's start-up registrations report a server that cannot be reached as the database
away (DATABASE_UNAVAILABLE, retriable), not as the driver's OSError: `kb indexer run` waits
for it at start, and a generation's pipeline built lazily fails its task as retriable
instead of killing it as a bug. The pool is a real one, on a port where no server listens."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.runtime.errors import DatabaseUnavailable

GENERATION = IndexGeneration("test-model-384", 384, "heading-semchunk-v1:max=256")


@pytest.fixture
async def unreachable_pool() -> AsyncIterator[asyncpg.Pool[Any]]:
    with socket.socket() as probe:  # a port just free: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # min_size=0: the pool opens without a connection, the first acquire makes one.
    pool = await asyncpg.create_pool(f"postgresql://postgres@127.0.0.1:{port}/kb", min_size=0)
    try:
        yield pool
    finally:
        await pool.close()


async def test_ensure_generation_on_an_unreachable_server(
    unreachable_pool: asyncpg.Pool[Any],
) -> None:
    with pytest.raises(DatabaseUnavailable):
        await PgVectorSink(unreachable_pool).ensure_generation(GENERATION)


async def test_register_default_on_an_unreachable_server(
    unreachable_pool: asyncpg.Pool[Any],
) -> None:
    with pytest.raises(DatabaseUnavailable):
        await PgVectorSink(unreachable_pool).register_default(
            GENERATION, chunk_max_tokens=256, chunk_overlap_tokens=0
        )
