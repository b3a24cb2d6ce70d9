"""The open database transaction a producer writes through, described by what it calls.

Code that writes inside someone else's transaction -- the indexer's sink inside the fenced
``complete``, the outbox writer inside any producer's transaction -- takes this protocol
rather than a driver type, so domain code and fakes need no driver. An asyncpg connection
(or pool connection) inside ``conn.transaction()`` satisfies it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any, Protocol


class Transaction(Protocol):
    """Statements run through it commit with the owner's transaction or not at all. Who
    is handed one must not commit, roll back or change session state (SET, LISTEN,
    session-level advisory locks) through it: the transaction is its owner's."""

    def is_in_transaction(self) -> bool: ...

    async def execute(self, query: str, *args: object) -> str: ...

    async def executemany(self, command: str, args: Iterable[Sequence[object]]) -> None: ...

    async def fetch(self, query: str, *args: object) -> list[Any]: ...

    async def fetchrow(self, query: str, *args: object) -> Any: ...

    async def fetchval(self, query: str, *args: object, column: int = ...) -> Any: ...

    async def copy_records_to_table(
        self,
        table_name: str,
        *,
        records: Iterable[Sequence[object]] | AsyncIterable[Sequence[object]],
        columns: Iterable[str] | None = ...,
        schema_name: str | None = ...,
    ) -> str: ...
