"""The indexer's PostgreSQL pool and what every indexer command shares: its settings from
the environment, a pool around one piece of work. Below the rooms that run commands (the
generations room, `kb indexer`, `kb index`), so none of them imports the CLI above it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from services.indexer.settings import IndexerSettings
from services.runtime.commands import cli_support

if TYPE_CHECKING:
    import asyncpg

T = TypeVar("T")


def load_settings(**overrides: Any) -> IndexerSettings:
    """The environment's settings; a bad one is a ConfigError that never shows its value."""
    return cli_support.load_settings(IndexerSettings, **overrides)


async def open_pool(settings: IndexerSettings, size: int) -> asyncpg.Pool[Any]:
    # The driver only when a pool is opened: `--help` of the commands stays cheap.
    from services.runtime.pg.db import create_pool_without_session_reset

    return await create_pool_without_session_reset(settings, min_size=1, max_size=size)


def with_pool(
    settings: IndexerSettings, size: int, work: Callable[[asyncpg.Pool[Any]], Awaitable[T]]
) -> T:
    async def _run() -> T:
        pool = await open_pool(settings, size)
        try:
            return await work(pool)
        finally:
            await pool.close()

    return cli_support.run_async(_run())
