"""services/runtime/pg/coalesce.py: the reads of callers who ask while one query is out share
the next query; the first never waits for a timer."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from services.runtime.pg.coalesce import Coalesced


class Store:
    """Squares of the keys asked, each query recorded; a query waits for ``release`` when
    ``held`` is set."""

    def __init__(self) -> None:
        self.queries: list[list[int]] = []
        self.held = False
        self.in_query = asyncio.Event()
        self.release = asyncio.Event()
        self.fail_with: Exception | None = None

    async def fetch(self, keys: Sequence[int]) -> Mapping[int, int]:
        self.queries.append(list(keys))
        self.in_query.set()
        if self.held:
            await self.release.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return {key: key * key for key in keys if key >= 0}


async def test_a_lone_caller_is_read_at_once() -> None:
    store = Store()
    reads = Coalesced(store.fetch)
    assert await reads.get(3) == 9
    assert await reads.get(-1) is None  # not found
    assert store.queries == [[3], [-1]]


async def test_callers_during_a_query_share_the_next_one() -> None:
    store = Store()
    store.held = True
    reads = Coalesced(store.fetch)
    first = asyncio.create_task(reads.get(1))
    await store.in_query.wait()
    waiting = [asyncio.create_task(reads.get_many([key, key + 10])) for key in (2, 3, 4)]
    await asyncio.sleep(0)
    store.release.set()
    assert await first == 1
    assert [await task for task in waiting] == [
        {2: 4, 12: 144},
        {3: 9, 13: 169},
        {4: 16, 14: 196},
    ]
    assert store.queries == [[1], [2, 12, 3, 13, 4, 14]]


async def test_a_query_holds_at_most_max_keys_and_never_splits_a_caller() -> None:
    store = Store()
    store.held = True
    reads = Coalesced(store.fetch, max_keys=3)
    first = asyncio.create_task(reads.get(0))
    await store.in_query.wait()
    waiting = [
        asyncio.create_task(reads.get_many(keys)) for keys in ([1, 2], [3, 4], [5], [6, 7, 8, 9])
    ]
    await asyncio.sleep(0)
    store.release.set()
    await asyncio.gather(first, *waiting)
    assert store.queries == [[0], [1, 2], [3, 4, 5], [6, 7, 8, 9]]


async def test_a_failed_query_fails_its_callers_and_the_next_query_runs() -> None:
    store = Store()
    store.held = True
    store.fail_with = RuntimeError("connection lost")
    reads = Coalesced(store.fetch)
    first = asyncio.create_task(reads.get(1))
    await store.in_query.wait()
    second = asyncio.create_task(reads.get(2))
    await asyncio.sleep(0)
    store.release.set()
    with pytest.raises(RuntimeError, match="connection lost"):
        await first
    with pytest.raises(RuntimeError, match="connection lost"):
        await second  # its own query, which failed too
    store.fail_with = None
    assert await reads.get(5) == 25


async def test_a_cancelled_caller_leaves_the_batch() -> None:
    store = Store()
    store.held = True
    reads = Coalesced(store.fetch)
    first = asyncio.create_task(reads.get(1))
    await store.in_query.wait()
    gone = asyncio.create_task(reads.get(2))
    stays = asyncio.create_task(reads.get(3))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    store.release.set()
    assert await first == 1
    assert await stays == 9
    assert store.queries == [[1], [3]]
