"""Reads of many concurrent callers in one query: the lookups that arrive while one query is
out go together in the next.

An indexer runs a task per slot, and the slots of one claim start together: each reads its
version, its generation and the embeddings it may reuse, a round trip apiece, for a few rows.
Coalesced, the first caller's query goes at once (no timer: at low load nothing waits), and
whoever asks meanwhile waits for it to return and then shares one query: under load a round
trip serves a claim's worth of tasks.

A failed query fails every caller of its batch with that error. A caller that is cancelled
leaves the batch (its key is still read if the query is already out).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")

# What one query reads: the value of each key found (a key not in the mapping: none).
FetchMany = Callable[[Sequence[Key]], Awaitable[Mapping[Key, Value]]]
# A caller's keys, and the future its query's result is set on.
_Waiting = tuple[tuple[Key, ...], "asyncio.Future[Mapping[Key, Value]]"]


class Coalesced(Generic[Key, Value]):
    """``get`` and ``get_many`` through ``fetch``, one query at a time, each for at most
    ``max_keys`` keys (a caller's keys are never split across two)."""

    def __init__(self, fetch: FetchMany[Key, Value], *, max_keys: int = 512) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self._fetch = fetch
        self._max_keys = max_keys
        self._waiting: deque[_Waiting[Key, Value]] = deque()
        self._reader: asyncio.Task[None] | None = None

    async def get(self, key: Key) -> Value | None:
        return (await self.get_many((key,))).get(key)

    async def get_many(self, keys: Iterable[Key]) -> Mapping[Key, Value]:
        """What the store holds of ``keys``: those found, with their values."""
        asked = tuple(dict.fromkeys(keys))
        if not asked:
            return {}
        future: asyncio.Future[Mapping[Key, Value]] = asyncio.get_running_loop().create_future()
        self._waiting.append((asked, future))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        found = await future
        return {key: found[key] for key in asked if key in found}

    async def _read(self) -> None:
        while self._waiting:
            batch = self._take()
            if not batch:
                continue
            keys = list(dict.fromkeys(key for asked, _ in batch for key in asked))
            try:
                found = await self._fetch(keys)
            except BaseException as error:
                for _, future in batch:
                    _fail(future, error)
                if not isinstance(error, Exception):
                    self._fail_waiting(error)
                    raise
                continue
            for _, future in batch:
                if not future.done():
                    future.set_result(found)

    def _take(self) -> list[_Waiting[Key, Value]]:
        batch: list[_Waiting[Key, Value]] = []
        count = 0
        while self._waiting:
            asked, future = self._waiting[0]
            if future.done():  # its caller was cancelled
                self._waiting.popleft()
                continue
            if batch and count + len(asked) > self._max_keys:
                break
            self._waiting.popleft()
            batch.append((asked, future))
            count += len(asked)
        return batch

    def _fail_waiting(self, error: BaseException) -> None:
        """The reader itself was cancelled (shutdown): nobody is left to read for those
        still waiting."""
        while self._waiting:
            _, future = self._waiting.popleft()
            _fail(future, error)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if future.done():
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(error)
