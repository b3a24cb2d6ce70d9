"""Waiting for a backend to wait: a lock wait is visible only from outside the session."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg


async def wait_until_blocked_on_a_lock(
    db: asyncpg.Pool[Any] | asyncpg.Connection[Any], backends: int = 1
) -> None:
    """Returns once ``backends`` backends of the database wait for a lock (at most 30 s).
    ``db``: a pool, or a connection of its own when the pool's idle connections must stay
    free for what is being watched; not one inside a transaction (pg_stat_activity is read
    once per transaction)."""
    async with asyncio.timeout(30):
        while True:
            blocked = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if blocked >= backends:
                return
            await asyncio.sleep(0.02)
