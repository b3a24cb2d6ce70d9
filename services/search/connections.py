"""Search's connections (index_pg): the one each search reads on, hybrid's second one when
one is idle, and how both go back to the pool -- their read-only transactions ended after
the answer, not before it."""

from __future__ import annotations

import asyncio
from typing import Any, Final, TypeAlias

import asyncpg

from services.runtime.logging import get_logger
from services.runtime.pg.db import create_pool_without_session_reset
from services.runtime.settings import RuntimeSettings
from services.search.read_pool import read_pool
from services.search.statements import SearchSettings

log = get_logger(__name__)

PooledConnection: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"

# How long hybrid search waits for an idle second connection before reading its lists in turn.
_SECOND_CONNECTION_WAIT_SECONDS: Final = 0.005


async def open_search_pool(settings: RuntimeSettings, **overrides: Any) -> asyncpg.Pool[Any]:
    """The pool search reads on (``kb serve``: also the operator page's reads and the search
    lag sampler). Released connections are not reset: search sets its planner settings with
    SET LOCAL, in a transaction it ends before release, and its other users set nothing, so
    asyncpg's ``RESET ALL; UNLISTEN *; ...`` would be a round trip per connection per search
    (two for hybrid) spent undoing nothing."""
    return await create_pool_without_session_reset(settings, **overrides)


class SearchConnections:
    """``pool``: the primary's; a request routed to a replica (read_pool) reads the replica's
    pool, and each connection goes back to the pool it came from."""

    def __init__(self, pool: asyncpg.Pool[Any], settings: SearchSettings) -> None:
        self._default_pool = pool
        self._timeout = settings.search_acquire_timeout_seconds
        self._growing: asyncio.Task[None] | None = None
        # Searches' transactions ending after their answers (end_later).
        self._ending: set[asyncio.Task[None]] = set()
        # id of a connection handed out -> the pool it came from, until it is released.
        self._owners: dict[int, asyncpg.Pool[Any]] = {}

    @property
    def _pool(self) -> asyncpg.Pool[Any]:
        return read_pool(self._default_pool)

    async def _take(self, pool: asyncpg.Pool[Any], wait_seconds: float) -> PooledConnection:
        conn = await pool.acquire(timeout=wait_seconds)
        self._owners[id(conn)] = pool
        return conn

    async def acquire(self) -> PooledConnection:
        """A search's connection: waits up to KB_SEARCH_ACQUIRE_TIMEOUT_SECONDS."""
        return await self._take(self._pool, self._timeout)

    async def idle(self) -> PooledConnection | None:
        """An idle connection of the pool, else None at once. Waiting for one to be opened
        would outlast reading the lists in turn, and a connect cut short by a timeout leaves
        asyncpg's half-done attempt behind (an error logged, a backend started for nothing).
        While the pool may grow, one more connection is opened in the background, for the
        searches that follow (the pool starts with KB_DB_POOL_MIN_SIZE, 1 by default)."""
        pool = self._pool
        if pool.get_idle_size() == 0:
            if self._growing is None and pool.get_size() < pool.get_max_size():
                self._growing = asyncio.create_task(self._grow(pool))
                # Cleared however it ends, cancelled before it ran included.
                self._growing.add_done_callback(self._grown)
            return None
        try:
            return await self._take(pool, _SECOND_CONNECTION_WAIT_SECONDS)
        except TimeoutError:  # taken meanwhile, and none to spare
            return None

    @property
    def growing(self) -> bool:
        return self._growing is not None

    async def _grow(self, pool: asyncpg.Pool[Any]) -> None:
        try:
            async with pool.acquire(timeout=self._timeout):
                pass
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
            log.warning("search.pool_growth_failed", error=str(error))

    def _grown(self, growing: asyncio.Task[None]) -> None:
        if self._growing is growing:
            self._growing = None

    def end_later(self, conn: PooledConnection, *, commit: bool) -> None:
        """Ends a search's transaction on ``conn`` and releases it, after the answer: the
        answer does not wait for the COMMIT of a read-only transaction nor for the pool's
        reset of the connection (two round trips). ``commit`` False: the search failed (or
        was cancelled), its transaction is rolled back."""
        ending = asyncio.create_task(self._end(conn, commit=commit))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)

    async def _end(self, conn: PooledConnection, *, commit: bool) -> None:
        # Nobody awaits this task: whatever goes wrong is logged here, and the connection
        # goes back to the pool whatever happened (asyncpg rolls back what is left, or
        # closes a connection it cannot reset; the pool opens another).
        try:
            await conn.execute("COMMIT" if commit else "ROLLBACK", timeout=self._timeout)
        except Exception as error:
            if commit:
                log.warning("search.commit_failed", error=str(error))
        finally:
            try:
                pool = self._owners.pop(id(conn), self._default_pool)
                await pool.release(conn, timeout=self._timeout)
            except Exception as error:
                log.warning("search.release_failed", error=str(error))

    async def settled(self) -> None:
        """Waits for what answered searches left running: their transactions ending (their
        connections back in the pool) and the pool's growth. Cancelling the wait cancels
        none of them."""
        while self._ending or self._growing is not None:
            running = [*self._ending, *([self._growing] if self._growing else [])]
            await asyncio.wait(running)
