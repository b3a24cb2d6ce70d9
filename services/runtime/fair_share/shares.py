"""Each tenant's requests in flight in this process and its token buckets, per kind.

One event loop owns this: no lock. A tenant's state lives while it has requests in flight
or a bucket that is not full again, and is forgotten after that (a sweep every
``SWEEP_SECONDS``): forgetting then loses nothing, as a new state starts with no request in
flight and full buckets. Memory is bounded by the tenants active in the last moments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Final

from services.runtime.errors import KbError
from services.runtime.fair_share.bucket import TokenBucket
from services.runtime.fair_share.settings import Kind, Limits

SWEEP_SECONDS: Final = 10.0
# When a tenant at its cap may try again: no one knows when one of its requests ends, and
# a second is long against a search and short against a client's patience.
CONCURRENCY_RETRY_AFTER_SECONDS: Final = 1


class TenantLimited(KbError, code="TENANT_LIMITED", retriable=True, http_status=429):
    """Beyond the tenant's share; ``retry_after_seconds`` says when to try again."""

    reason: ClassVar[str] = "limited"

    def __init__(self, message: str, *, retry_after_seconds: int) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class TenantRateLimited(TenantLimited, code="TENANT_RATE_LIMITED"):
    reason = "rate"


class TenantConcurrencyLimited(TenantLimited, code="TENANT_CONCURRENCY_LIMITED"):
    reason = "concurrency"


class SearchSlotWaitTimeout(TenantLimited, code="SEARCH_SLOT_WAIT_TIMEOUT"):
    """An admitted search found no search slot within KB_FAIR_SEARCH_SLOT_WAIT_SECONDS."""

    reason = "slot_wait"


@dataclass
class _TenantState:
    in_flight: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    buckets: dict[Kind, TokenBucket] = field(default_factory=dict)

    def idle(self, now: float) -> bool:
        return not any(self.in_flight.values()) and all(
            bucket.is_full(now) for bucket in self.buckets.values()
        )


class TenantShares:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}
        self._swept = clock()

    def enter(self, tenant_id: str, kind: Kind, limits: Limits) -> None:
        """Count one request of ``kind`` in flight for the tenant, or raise
        ``TenantConcurrencyLimited`` / ``TenantRateLimited`` (nothing counted, no token
        taken by a refusal at the cap)."""
        now = self._clock()
        self._sweep(now)
        state = self._states.setdefault(tenant_id, _TenantState())
        if limits.concurrency and state.in_flight[kind] >= limits.concurrency:
            raise TenantConcurrencyLimited(
                f"this tenant has {limits.concurrency} {kind.value} requests in progress, "
                "its share of this server; retry after the time in Retry-After",
                retry_after_seconds=CONCURRENCY_RETRY_AFTER_SECONDS,
            )
        if limits.rate > 0:
            wait = self._bucket(state, kind, limits, now).take(now)
            if wait > 0:
                raise TenantRateLimited(
                    f"this tenant starts at most {limits.rate:g} {kind.value} requests a "
                    f"second (bursts of {limits.burst}); retry after the time in Retry-After",
                    retry_after_seconds=max(1, math.ceil(wait)),
                )
        else:
            state.buckets.pop(kind, None)
        state.in_flight[kind] += 1

    def leave(self, tenant_id: str, kind: Kind) -> None:
        state = self._states[tenant_id]
        state.in_flight[kind] -= 1
        if state.idle(self._clock()):
            del self._states[tenant_id]

    def in_flight(self, tenant_id: str, kind: Kind) -> int:
        state = self._states.get(tenant_id)
        return state.in_flight[kind] if state is not None else 0

    def tracked(self) -> int:
        """How many tenants' states are held (bounded memory: tests read it)."""
        return len(self._states)

    def _bucket(self, state: _TenantState, kind: Kind, limits: Limits, now: float) -> TokenBucket:
        bucket = state.buckets.get(kind)
        if bucket is None:
            bucket = state.buckets[kind] = TokenBucket(
                rate=limits.rate, burst=limits.burst, updated=now
            )
        elif (bucket.rate, bucket.burst) != (limits.rate, limits.burst):
            bucket.adjust(limits.rate, limits.burst)
        return bucket

    def _sweep(self, now: float) -> None:
        if now - self._swept < SWEEP_SECONDS:
            return
        self._swept = now
        for tenant_id in [t for t, state in self._states.items() if state.idle(now)]:
            del self._states[tenant_id]
