"""The process's search slots, shared fairly between tenants.

At most ``slots`` searches run at once. A search that finds them all taken waits in its
tenant's queue; when a slot frees, it goes to the waiting tenant that runs the fewest
searches at that moment, and among equals to the one served least recently (a tenant with
nothing running or waiting counts as never served). So a tenant alone uses every slot, and
another tenant's search that arrives meanwhile takes the next slot to free: it waits
behind at most one running search, however many the first tenant has queued.

Why slots at all: a search's work is done by PostgreSQL and the query embedding, on the
same few cores for every tenant. Capping one tenant's requests in flight does not keep its
admitted searches from taking those cores; running few searches at once and choosing who
runs next does.

One event loop owns this: no lock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class SearchSlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("at least one slot")
        self.slots = slots
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        # When each tenant with searches running or waiting was last given a slot (a count
        # of grants): the tie-break between tenants running as many.
        self._served: dict[str, int] = {}
        self._grants = 0

    @property
    def in_use(self) -> int:
        return sum(self._running.values())

    def waiting(self, tenant_id: str | None = None) -> int:
        if tenant_id is not None:
            return len(self._waiting.get(tenant_id, ()))
        return sum(len(queue) for queue in self._waiting.values())

    @asynccontextmanager
    async def slot(self, tenant_id: str) -> AsyncIterator[None]:
        """Hold one slot for the body; wait for it, in the tenant's turn, if none is free."""
        await self._acquire(tenant_id)
        try:
            yield
        finally:
            self._release(tenant_id)

    async def _acquire(self, tenant_id: str) -> None:
        if self.in_use < self.slots and not self._waiting:
            self._take(tenant_id)
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant_id, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                # Granted in the same moment the waiter went away: hand the slot on.
                self._release(tenant_id)
            else:
                self._forget(tenant_id, granted)
            raise

    def _take(self, tenant_id: str) -> None:
        self._running[tenant_id] = self._running.get(tenant_id, 0) + 1
        self._grants += 1
        self._served[tenant_id] = self._grants

    def _release(self, tenant_id: str) -> None:
        left = self._running[tenant_id] - 1
        if left:
            self._running[tenant_id] = left
        else:
            del self._running[tenant_id]
            self._forget_if_idle(tenant_id)
        self._hand_out()

    def _forget_if_idle(self, tenant_id: str) -> None:
        if tenant_id not in self._running and tenant_id not in self._waiting:
            self._served.pop(tenant_id, None)

    def _turn(self, tenant_id: str) -> tuple[int, int]:
        return self._running.get(tenant_id, 0), self._served.get(tenant_id, -1)

    def _hand_out(self) -> None:
        while self.in_use < self.slots and self._waiting:
            # The fewest running first, then the least recently served; min() keeps the
            # first (longest waiting) of equals.
            tenant_id = min(self._waiting, key=self._turn)
            queue = self._waiting.pop(tenant_id)
            granted = queue.popleft()
            if queue:
                self._waiting[tenant_id] = queue
            if granted.cancelled():
                self._forget_if_idle(tenant_id)
                continue
            granted.set_result(None)
            self._take(tenant_id)

    def _forget(self, tenant_id: str, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant_id)
        if queue is None:
            return
        try:
            queue.remove(granted)
        except ValueError:
            return
        if not queue:
            del self._waiting[tenant_id]
            self._forget_if_idle(tenant_id)
