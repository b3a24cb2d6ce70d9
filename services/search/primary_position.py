"""The primary's WAL position: what a search token may name (docs/scaling.md#read-your-switch).

Every token the service hands out (a status's ``searchToken``, the ``search_token`` header
of a DocumentSearchVersionSwitched event) is a position the primary had written when it was
read: its WAL insert position, or on a replica a position received from it. So a token past
the primary's insert position was never handed out, and no replica will ever replay it; a
search naming one would only wait for nothing. It is refused: 422 ``SEARCH_TOKEN_AHEAD``.

The highest position read is kept (the replicas' lag check reads it every round): a position
only grows, so a token at or below it needs no round trip. A token above it may have been
minted a moment ago: the primary is read once more -- one read at a time, shared by every
search that waits for a read started after it came -- before the token is refused. When the
primary cannot be read within the timeout nothing is refused (the search then reads as
before, its wait bounded).
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import asyncpg

from services.runtime.errors import ValidationFailed
from services.runtime.logging import get_logger

log = get_logger(__name__)

_INSERT_SQL: Final = "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint"
READ_ERRORS: Final = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


class SearchTokenAhead(ValidationFailed, code="SEARCH_TOKEN_AHEAD"):
    """An ``after`` token names a WAL position the primary has not written."""


class PrimaryPosition:
    def __init__(self, pool: asyncpg.Pool[Any], *, timeout_seconds: float) -> None:
        self._pool = pool
        self._timeout = timeout_seconds
        self.position: int | None = None  # the highest insert position read
        self._reads = 0  # reads started so far
        self._reading: asyncio.Task[int | None] | None = None

    def observe(self, position: int) -> None:
        if self.position is None or position > self.position:
            self.position = position

    async def read(self) -> int | None:
        """The primary's insert position from a read started after this call (None: it
        could not be read within the timeout)."""
        wanted = self._reads + 1
        while True:
            reading = self._reading
            if reading is not None and self._reads >= wanted:
                # Shielded: a search that goes away does not cancel the others' read.
                return await asyncio.shield(reading)
            if reading is not None and not reading.done():
                await asyncio.wait([reading])  # started before this call: not good enough
                continue
            self._reads += 1
            self._reading = asyncio.create_task(self._read_once())

    async def check_written(self, token: int, token_text: str | None = None) -> None:
        """Raise ``SearchTokenAhead`` when the primary has not written ``token``."""
        if self.position is not None and token <= self.position:
            return
        position = await self.read()
        if position is not None and token > position:
            raise SearchTokenAhead(
                f"the search token {token_text or token} names a WAL position the database "
                "has not written; send a searchToken the service handed out"
            )

    async def aclose(self) -> None:
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)

    async def _read_once(self) -> int | None:
        try:
            # The pool's acquire too: a pool whose connections are all busy must not hang it.
            async with asyncio.timeout(self._timeout):
                position = await self._pool.fetchval(_INSERT_SQL)
        except READ_ERRORS as error:
            log.warning(
                "search.primary_position_unread", error=f"{type(error).__name__}: {error}"[:300]
            )
            return None
        self.observe(int(position))
        return int(position)
