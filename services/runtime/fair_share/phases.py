"""When a search holds its slot (``slots.py``), and the boundaries between its phases, where
the slot may go to a quieter tenant.

The gate admits a search (its tenant's cap and bucket) and leaves a ticket for a slot in a
context variable; the search takes the slot with ``search_slot`` only once it is ready to
read -- after any wait for a read replica that has replayed its ``after`` tokens -- and
gives it back as soon as its results are in, before its answer is written: a slot is the
process's cores, and neither a wait for a replica nor a client slow to read its answer uses
them. The searcher, which knows its phases but not the request's share, calls
``between_search_phases`` at each boundary. Without a ticket (fair shares off, no slots, a
search outside a request) both do nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from services.runtime.fair_share.metrics import REFUSALS, SLOT_WAIT, STEPPED_ASIDE
from services.runtime.fair_share.settings import Kind
from services.runtime.fair_share.shares import TenantLimited
from services.runtime.fair_share.slots import HeldSlot, SearchSlots


@dataclass(frozen=True)
class SearchShare:
    """The slot of the request being served, and the labels of its metrics."""

    slot: HeldSlot
    tier: str
    clock: Callable[[], float] = time.monotonic
    refused: Callable[[TenantLimited], None] | None = None


@dataclass(frozen=True)
class SlotTicket:
    """An admitted search's right to wait for one of the process's slots."""

    slots: SearchSlots
    tenant_id: str
    tier: str
    clock: Callable[[], float] = time.monotonic
    # The gate's record of a refusal (its log line); the counter is counted here.
    refused: Callable[[TenantLimited], None] | None = None


PENDING_SEARCH: ContextVar[SlotTicket | None] = ContextVar("fair_share_ticket", default=None)
CURRENT_SEARCH: ContextVar[SearchShare | None] = ContextVar("fair_share_search", default=None)


@asynccontextmanager
async def search_slot() -> AsyncIterator[None]:
    """Hold one of the process's search slots for the body, waiting for the tenant's turn
    (at most KB_FAIR_SEARCH_SLOT_WAIT_SECONDS: then ``SearchSlotWaitTimeout``, 429). Inside
    a body that holds one already, nothing more."""
    ticket = PENDING_SEARCH.get()
    if ticket is None or CURRENT_SEARCH.get() is not None:
        yield
        return
    started = ticket.clock()
    granted = False
    try:
        async with ticket.slots.slot(ticket.tenant_id) as held:
            granted = True
            SLOT_WAIT.labels(ticket.tier).observe(ticket.clock() - started)
            share = SearchShare(held, ticket.tier, ticket.clock, ticket.refused)
            current = CURRENT_SEARCH.set(share)
            try:
                yield
            finally:
                CURRENT_SEARCH.reset(current)
    except TenantLimited as refusal:
        if not granted:  # the body's own refusals are counted where they happen
            _refused(ticket.tier, ticket.refused, refusal)
        raise


async def between_search_phases() -> None:
    """One phase of the request's search is done and the next starts: step aside for a
    quieter tenant waiting for a slot, if any, and wait for the slot again."""
    share = CURRENT_SEARCH.get()
    if share is None:
        return
    started = share.clock()
    try:
        stepped = await share.slot.step_aside()
    except TenantLimited as refusal:
        _refused(share.tier, share.refused, refusal)
        raise
    if stepped:
        STEPPED_ASIDE.labels(share.tier).inc()
        SLOT_WAIT.labels(share.tier).observe(share.clock() - started)


def _refused(
    tier: str, record: Callable[[TenantLimited], None] | None, refusal: TenantLimited
) -> None:
    REFUSALS.labels(Kind.SEARCH.value, tier, refusal.reason).inc()
    if record is not None:
        record(refusal)
