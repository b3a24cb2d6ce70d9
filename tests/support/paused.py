"""A completion's write held inside its transaction, for tests that act while it is open."""

from __future__ import annotations

import asyncio

from services.indexer.ports import InTransaction
from services.runtime.pg.transaction import Transaction


class PausedWrite:
    """Runs ``write`` in the completion's transaction, then sets ``reached`` and waits for
    ``release`` before the transaction may commit: its rows are written and its locks held
    meanwhile. With ``before_write`` it pauses before writing instead (the fence taken,
    nothing of the write yet)."""

    def __init__(self, write: InTransaction, *, before_write: bool = False) -> None:
        self._write = write
        self._before_write = before_write
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, conn: Transaction) -> None:
        if not self._before_write:
            await self._write(conn)
        self.reached.set()
        await self.release.wait()
        if self._before_write:
            await self._write(conn)
