"""Waiting for a backend to wait: a lock wait is visible only from outside the session."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg


async def wait_until_blocked_on_a_lock(pool: asyncpg.Pool[Any]) -> None:
    """Returns once a backend of the pool's database waits for a lock (at most 30 s)."""
    async with asyncio.timeout(30):
        while True:
            blocked = await pool.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity"
                "  WHERE datname = current_database() AND wait_event_type = 'Lock')"
            )
            if blocked:
                return
            await asyncio.sleep(0.02)
