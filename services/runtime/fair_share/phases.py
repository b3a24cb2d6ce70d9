"""The boundaries between a search's phases, where its slot may go to a quieter tenant
(``slots.py``). The gate puts the request's slot in a context variable; the searcher, which
knows its phases but not the request's share, calls ``between_search_phases`` at each
boundary. Without a slot (fair shares off, no slots, a search outside a request) it does
nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from services.runtime.fair_share.metrics import SLOT_WAIT, STEPPED_ASIDE
from services.runtime.fair_share.slots import HeldSlot


@dataclass(frozen=True)
class SearchShare:
    """The slot of the request being served, and the labels of its metrics."""

    slot: HeldSlot
    tier: str
    clock: Callable[[], float] = time.monotonic


CURRENT_SEARCH: ContextVar[SearchShare | None] = ContextVar("fair_share_search", default=None)


async def between_search_phases() -> None:
    """One phase of the request's search is done and the next starts: step aside for a
    quieter tenant waiting for a slot, if any, and wait for the slot again."""
    share = CURRENT_SEARCH.get()
    if share is None:
        return
    started = share.clock()
    if await share.slot.step_aside():
        STEPPED_ASIDE.labels(share.tier).inc()
        SLOT_WAIT.labels(share.tier).observe(share.clock() - started)
