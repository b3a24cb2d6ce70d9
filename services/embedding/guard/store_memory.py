"""The provider state in this process's memory: for tests, and for a single process that
shares its provider with no other. Every step holds one lock, as ``store_pg`` holds the
rows' locks: the same contract (tests/contract/test_provider_guard_contract.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from services.embedding.guard.breaker import Breaker, BreakerPolicy
from services.embedding.guard.ports import ProbeTaken, ProviderView
from services.embedding.guard.quota import (
    Charge,
    QuotaPlan,
    Reservation,
    capped_tats,
    paused_tats,
    reserve,
)
from services.runtime.pg.clock import Clock


@dataclass
class _Provider:
    paused_until: datetime | None = None
    breaker: Breaker = field(default_factory=Breaker)
    updated_at: datetime | None = None
    tats: dict[str, datetime] = field(default_factory=dict)


class InMemoryProviderStateStore:
    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock
        self._providers: dict[str, _Provider] = {}
        self._lock = asyncio.Lock()

    def _now(self) -> datetime:
        now = self._clock.now() if self._clock is not None else None
        return now if now is not None else datetime.now(UTC)

    def _row(self, provider: str) -> _Provider:
        return self._providers.setdefault(provider, _Provider())

    def _view(self, provider: str, now: datetime) -> ProviderView:
        row = self._providers.get(provider)
        if row is None:
            return ProviderView(provider, now)
        return ProviderView(provider, now, row.paused_until, row.breaker, row.updated_at)

    def tats(self, provider: str) -> dict[str, datetime]:
        """The buckets' tats (for tests)."""
        return dict(self._row(provider).tats)

    async def view(self, provider: str) -> ProviderView:
        return self._view(provider, self._now())

    async def reserve(
        self, provider: str, charges: Sequence[Charge], *, max_wait_seconds: float
    ) -> Reservation:
        async with self._lock:
            now = self._now()
            row = self._row(provider)
            reservation = reserve(
                now, row.paused_until, row.tats, charges, max_wait_seconds=max_wait_seconds
            )
            row.tats.update(reservation.tats)
            return reservation

    async def pause(self, provider: str, *, seconds: float, plan: QuotaPlan) -> ProviderView:
        async with self._lock:
            now = self._now()
            row = self._row(provider)
            until = now + timedelta(seconds=seconds)
            if row.paused_until is None or row.paused_until < until:
                row.paused_until = until
                row.updated_at = now
            row.tats.update(paused_tats(row.tats, row.paused_until, plan))
            return self._view(provider, now)

    async def cap_pause(
        self, provider: str, *, max_seconds: float, plan: QuotaPlan
    ) -> ProviderView:
        async with self._lock:
            now = self._now()
            row = self._row(provider)
            until = now + timedelta(seconds=max_seconds)
            if row.paused_until is not None and row.paused_until > until:
                row.paused_until = until
                row.updated_at = now
            row.tats.update(capped_tats(row.tats, until, plan))
            return self._view(provider, now)

    async def take_probe(self, provider: str, *, owner: str, policy: BreakerPolicy) -> ProbeTaken:
        async with self._lock:
            now = self._now()
            row = self._row(provider)
            probing = row.breaker.take_probe(owner, now, policy)
            if probing is not None:
                self._set(row, probing, now)
            return ProbeTaken(self._view(provider, now), probing is not None)

    async def record_failure(
        self, provider: str, *, code: str, probe_owner: str | None, policy: BreakerPolicy
    ) -> ProviderView:
        async with self._lock:
            now = self._now()
            row = self._row(provider)
            self._set(row, row.breaker.failed(code, now, policy, probe_owner=probe_owner), now)
            return self._view(provider, now)

    async def record_success(self, provider: str) -> ProviderView:
        async with self._lock:
            now = self._now()
            row = self._row(provider)
            self._set(row, row.breaker.succeeded(now), now)
            return self._view(provider, now)

    @staticmethod
    def _set(row: _Provider, breaker: Breaker, now: datetime) -> None:
        if breaker != row.breaker:
            row.breaker = breaker
            row.updated_at = now
