"""The tier of an authenticated tenant, which chooses its limits: read from the ``tenant``
table and kept ``KB_FAIR_TIER_CACHE_SECONDS`` (a tier rarely changes; a change applies
within that time)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, Protocol

from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

log = get_logger(__name__)
QUERIES = queries_beside(__file__, "tiers.sql")


class TenantTiers(Protocol):
    async def tier_of(self, tenant_id: str) -> str | None:
        """The tenant's tier; None for a tenant the table does not hold."""
        ...


class PgTenantTiers:
    def __init__(self, pool: Any) -> None:
        self._pool = pool

    async def tier_of(self, tenant_id: str) -> str | None:
        with translate_db_errors():
            tier: str | None = await self._pool.fetchval(QUERIES["tenant_tier"], tenant_id)
        return tier


# The longest a request waits for its tenant's tier (a pool whose connections are all
# busy) before it goes on with the flat limits.
READ_TIMEOUT_SECONDS: Final = 1.0


class CachedTiers:
    """Each tenant's tier for ``ttl_seconds``. An unreadable tier (the database busy or
    slower than ``READ_TIMEOUT_SECONDS``) is not kept: the request gets the flat limits,
    and the next one reads it again."""

    def __init__(self, tiers: TenantTiers, ttl_seconds: float, clock: Callable[[], float]) -> None:
        self._tiers = tiers
        self._ttl = ttl_seconds
        self._clock = clock
        self._known: dict[str, tuple[str | None, float]] = {}
        self._swept = clock()

    async def tier_of(self, tenant_id: str) -> str | None:
        now = self._clock()
        self._sweep(now)
        known = self._known.get(tenant_id)
        if known is not None and known[1] > now:
            return known[0]
        try:
            tier = await asyncio.wait_for(self._tiers.tier_of(tenant_id), READ_TIMEOUT_SECONDS)
        except Exception as error:  # a limiter never fails a request on its own account
            log.warning(
                "fair_share.tier_unknown",
                tenant_id=tenant_id,
                error=f"{type(error).__name__}: {error}",
            )
            return None
        if self._ttl > 0:
            self._known[tenant_id] = (tier, now + self._ttl)
        return tier

    def cached(self) -> int:
        return len(self._known)

    def _sweep(self, now: float) -> None:
        # Bounded memory: the tenants seen within the last ttl, swept every ttl.
        if now - self._swept < self._ttl:
            return
        self._swept = now
        for tenant_id in [t for t, (_, expires) in self._known.items() if expires <= now]:
            del self._known[tenant_id]
