"""The process's search slots, shared fairly between tenants.

At most ``slots`` searches run at once. A search that finds them all taken waits in its
tenant's queue; when a slot frees, it goes to the waiting tenant that runs the fewest
searches at that moment, and among equals to the one served least recently (a tenant with
nothing running or waiting counts as never served). So a tenant alone uses every slot, and
another tenant's search that arrives meanwhile takes the next slot to free: it waits
behind at most one running search, however many the first tenant has queued.

A slot also frees between the phases of a search (``HeldSlot.step_aside``: before the
query's embedding, before the database's lists) when a tenant with fewer searches in the
process -- running or waiting -- than the search's own is waiting: the slot goes to it at
once, and the search waits for the next one to free, first in its tenant's line. So a quiet
tenant's search waits behind one phase of a busier tenant's search, not a whole one, and
once running it does not step aside for the busier tenant (which has more searches, not
fewer). Tenants as busy as each other never step aside for one another: between them the
turns above decide.

A wait for a slot lasts at most ``wait_seconds`` (KB_FAIR_SEARCH_SLOT_WAIT_SECONDS), then
the search is refused (``SearchSlotWaitTimeout``, 429): nobody is left to read an answer
that took longer, and every search queued behind it would wait for it too.

Why slots at all: a search's work is done by PostgreSQL and the query embedding, on the
same few cores for every tenant. Capping one tenant's requests in flight does not keep its
admitted searches from taking those cores; running few searches at once and choosing who
runs next does.

One event loop owns this: no lock.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from services.runtime.fair_share.shares import SearchSlotWaitTimeout


class HeldSlot:
    """One search's slot, from its grant to the end of the search."""

    def __init__(self, slots: SearchSlots, tenant_id: str) -> None:
        self._slots = slots
        self.tenant_id = tenant_id
        # False while the search waits again after stepping aside (a cancelled wait leaves
        # nothing to release).
        self.held = True

    async def step_aside(self) -> bool:
        """At a boundary between two phases of the search: hand the slot to a waiting
        tenant with fewer searches in the process than this one's, if there is one, and
        wait for a slot again, first in this tenant's line. True when it stepped aside."""
        return await self._slots._step_aside(self)


class SearchSlots:
    def __init__(self, slots: int, *, wait_seconds: float | None = None) -> None:
        if slots < 1:
            raise ValueError("at least one slot")
        self.slots = slots
        self.wait_seconds = wait_seconds  # None: wait as long as it takes
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
    async def slot(self, tenant_id: str) -> AsyncIterator[HeldSlot]:
        """Hold one slot for the body; wait for it, in the tenant's turn, if none is free."""
        if self.in_use < self.slots and not self._waiting:
            self._take(tenant_id)
        else:
            await self._wait(tenant_id, first=False)
        held = HeldSlot(self, tenant_id)
        try:
            yield held
        finally:
            if held.held:
                self._release(tenant_id)

    async def _wait(self, tenant_id: str, *, first: bool) -> None:
        """Wait in the tenant's line (``first``: at its head) until a slot is handed over,
        at most ``wait_seconds``."""
        granted = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant_id, deque())
        if first:
            queue.appendleft(granted)
        else:
            queue.append(granted)
        deadline = asyncio.timeout(self.wait_seconds)
        try:
            async with deadline:
                try:
                    await granted
                except asyncio.CancelledError:
                    if granted.done() and not granted.cancelled():
                        # Granted in the same moment the waiter went away: hand it on.
                        self._release(tenant_id)
                    else:
                        self._forget(tenant_id, granted)
                    raise
        except TimeoutError:
            if not deadline.expired():
                raise
            raise SearchSlotWaitTimeout(
                f"no search slot of this server was free within {self.wait_seconds:g} s; "
                "retry after the time in Retry-After",
                retry_after_seconds=max(1, math.ceil(self.wait_seconds or 1)),
            ) from None

    async def _step_aside(self, held: HeldSlot) -> bool:
        tenant_id = held.tenant_id
        if not held.held:
            raise RuntimeError("the slot is not held")
        own = self._searches(tenant_id)
        # Straight to the quieter tenant whose turn it is: a release would hand the slot to
        # whoever's turn it is, possibly this search's own tenant.
        while True:
            quieter = [t for t in self._waiting if t != tenant_id and self._searches(t) < own]
            if not quieter:
                return False
            if self._grant(min(quieter, key=self._turn)):
                break
            # (that tenant's waiters had all gone away: it left the line)
        self._running[tenant_id] -= 1
        if not self._running[tenant_id]:
            del self._running[tenant_id]
        held.held = False
        # Before the tenant's searches that have not started: this one ends sooner.
        await self._wait(tenant_id, first=True)
        held.held = True
        return True

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

    def _searches(self, tenant_id: str) -> int:
        """The tenant's searches in the process: running and waiting."""
        return self._running.get(tenant_id, 0) + len(self._waiting.get(tenant_id, ()))

    def _turn(self, tenant_id: str) -> tuple[int, int]:
        return self._running.get(tenant_id, 0), self._served.get(tenant_id, -1)

    def _hand_out(self) -> None:
        while self.in_use < self.slots and self._waiting:
            # The fewest running first, then the least recently served; min() keeps the
            # first (longest waiting) of equals.
            self._grant(min(self._waiting, key=self._turn))

    def _grant(self, tenant_id: str) -> bool:
        """Give a slot to the first live waiter of the tenant's line; False when none was
        left (cancelled waiters are dropped on the way)."""
        while (queue := self._waiting.get(tenant_id)) is not None:
            granted = queue.popleft()
            if not queue:
                del self._waiting[tenant_id]
            if granted.cancelled():
                self._forget_if_idle(tenant_id)
                continue
            granted.set_result(None)
            self._take(tenant_id)
            return True
        return False

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
