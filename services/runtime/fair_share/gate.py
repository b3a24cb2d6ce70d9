"""The fair share of one request: its tenant's cap and bucket, then (a search) a slot, taken
when the search is ready to read (``phases.search_slot``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from services.runtime.fair_share.metrics import REFUSALS, UNKNOWN_TIER
from services.runtime.fair_share.phases import PENDING_SEARCH, SlotTicket, search_slot
from services.runtime.fair_share.settings import FairShareSettings, Kind
from services.runtime.fair_share.shares import TenantLimited, TenantShares
from services.runtime.fair_share.slots import SearchSlots
from services.runtime.fair_share.tiers import CachedTiers, TenantTiers
from services.runtime.logging import get_logger

log = get_logger(__name__)

# A tenant refused again within this many seconds is not logged again (the counter counts
# every refusal): a flood must not flood the log too.
LOG_EVERY_SECONDS = 60.0


class _NoTiers:
    """Before the app's pool is open (or in an app given no tier lookup): the flat limits."""

    async def tier_of(self, tenant_id: str) -> str | None:
        return None


class FairShare:
    def __init__(
        self,
        settings: FairShareSettings,
        tiers: TenantTiers | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self.shares = TenantShares(clock)
        slots = settings.search_slots()
        self.slots = (
            SearchSlots(slots, wait_seconds=settings.search_slot_wait_seconds) if slots else None
        )
        self._tiers = CachedTiers(tiers or _NoTiers(), settings.tier_cache_seconds, clock)
        self._logged: dict[tuple[str, Kind], float] = {}

    def use_tiers(self, tiers: TenantTiers) -> None:
        """Read tiers through ``tiers`` from now on (the app's pool opens in its lifespan)."""
        self._tiers = CachedTiers(tiers, self.settings.tier_cache_seconds, self._clock)

    @asynccontextmanager
    async def admit(self, tenant_id: str, kind: Kind) -> AsyncIterator[None]:
        """Hold the tenant's share for the body -- a request in flight -- or raise
        ``TenantLimited`` (429). A search is left a ticket for one of the process's slots,
        which it takes with ``phases.search_slot`` once it is ready to read."""
        tier = await self._tiers.tier_of(tenant_id)
        try:
            self.shares.enter(tenant_id, kind, self.settings.limits(tier, kind))
        except TenantLimited as refusal:
            self._refused(tenant_id, tier, kind, refusal)
            raise
        try:
            if kind is Kind.SEARCH and self.slots is not None:
                ticket = SlotTicket(
                    self.slots,
                    tenant_id,
                    tier or UNKNOWN_TIER,
                    self._clock,
                    lambda refusal: self._logged_refusal(tenant_id, tier, kind, refusal),
                )
                pending = PENDING_SEARCH.set(ticket)
                try:
                    yield
                finally:
                    PENDING_SEARCH.reset(pending)
            else:
                yield
        finally:
            self.shares.leave(tenant_id, kind)

    @asynccontextmanager
    async def share(self, tenant_id: str, kind: Kind) -> AsyncIterator[None]:
        """``admit``, and for a search one of the process's slots for the whole body
        (waiting for its turn; the search may step aside between its phases: ``phases.py``)."""
        async with self.admit(tenant_id, kind), search_slot():
            yield

    def _refused(
        self, tenant_id: str, tier: str | None, kind: Kind, refusal: TenantLimited
    ) -> None:
        REFUSALS.labels(kind.value, tier or UNKNOWN_TIER, refusal.reason).inc()
        self._logged_refusal(tenant_id, tier, kind, refusal)

    def _logged_refusal(
        self, tenant_id: str, tier: str | None, kind: Kind, refusal: TenantLimited
    ) -> None:
        now = self._clock()
        key = (tenant_id, kind)
        last = self._logged.get(key)
        if last is not None and now - last < LOG_EVERY_SECONDS:
            return
        if len(self._logged) > 1000:  # bounded: old entries only suppress a log line
            self._logged = {k: t for k, t in self._logged.items() if now - t < LOG_EVERY_SECONDS}
        self._logged[key] = now
        log.info(
            "fair_share.limited",
            tenant_id=tenant_id,
            tier=tier,
            kind=kind.value,
            error_code=refusal.code,
            retry_after_seconds=refusal.retry_after_seconds,
        )
