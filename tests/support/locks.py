"""Waiting for a backend to wait: a lock wait is visible only from outside the session."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import asyncpg


async def wait_until_blocked_on_a_lock(
    db: asyncpg.Pool[Any] | asyncpg.Connection[Any],
    backends: int = 1,
    *,
    started_after: datetime | None = None,
) -> None:
    """Returns once ``backends`` backends of the database wait for a lock (at most 30 s),
    in statements started after ``started_after`` when given (a retry, not the first try).
    ``db``: a pool, or a connection of its own when the pool's idle connections must stay
    free for what is being watched; not one inside a transaction (pg_stat_activity is read
    once per transaction)."""
    async with asyncio.timeout(30):
        while True:
            blocked = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                "   AND ($1::timestamptz IS NULL OR query_start > $1)",
                started_after,
            )
            if blocked >= backends:
                return
            await asyncio.sleep(0.02)


class RowTaker:
    """A second session that takes the rows a batch is about to take (its statement run in
    a transaction left open) and commits once that batch waits on their row locks: the
    race in which a batch's snapshot holds rows it then finds gone."""

    def __init__(self, database_url: str) -> None:
        self._database_url = database_url
        self._commits: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> RowTaker:
        self._second = await asyncpg.connect(self._database_url)
        try:
            self._watcher = await asyncpg.connect(self._database_url)
        except BaseException:
            await self._second.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # A commit still waiting (the code under test failed first) must not outlive the
        # connections it polls.
        for commit in self._commits:
            commit.cancel()
        await asyncio.gather(*self._commits, return_exceptions=True)
        try:
            await self._second.close()
        finally:
            await self._watcher.close()

    @property
    def took(self) -> bool:
        return bool(self._commits)

    async def take(self, query: str, *args: Any) -> asyncpg.Record | None:
        """``query``'s first row, run by the second session in a transaction committed
        once a backend of the database waits on a lock."""
        taking = self._second.transaction()
        await taking.start()
        row = await self._second.fetchrow(query, *args)
        self._commits.append(asyncio.create_task(self._commit_once_blocked(taking)))
        return row

    async def committed(self) -> None:
        await self._commits[0]

    async def _commit_once_blocked(self, taking: asyncpg.transaction.Transaction) -> None:
        await wait_until_blocked_on_a_lock(self._watcher)
        await taking.commit()
