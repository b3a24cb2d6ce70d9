"""``KB_FAIR_*``: each tier's share of a ``kb serve`` process (docs/configuration.md).

The limits are per process: with N API processes behind a balancer a tenant may have N
times them in flight. The defaults are meant to go unnoticed by a tenant alone on the
service: no rate at all, and caps on requests in flight that a single client reaches only
by queueing far more than the process can run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.runtime.cpus import usable_cores

TIER_PATTERN: Final = r"^[a-z0-9][a-z0-9_-]{0,31}$"
# The cores one hybrid search keeps busy: its vector and keyword lists run at once on two
# connections, with the query's model run (onnx-local) beside them.
CPUS_PER_SEARCH: Final = 2


class Kind(enum.StrEnum):
    """What a request asks for: each kind has its own caps and buckets."""

    SEARCH = "search"
    PUBLISH = "publish"


@dataclass(frozen=True)
class Limits:
    """One tier's share of one kind of request."""

    # Requests of one tenant in flight in this process (searches waiting for a slot
    # included); 0: no cap.
    concurrency: int
    # Requests per second one tenant may start (a token bucket); 0: no bucket.
    rate: float
    # How many the bucket holds: a burst after a quiet spell.
    burst: int


class TierLimits(BaseModel):
    """A tier's own values; what it leaves out is the flat setting's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    search_concurrency: int | None = Field(default=None, ge=0)
    search_rate: float | None = Field(default=None, ge=0)
    search_burst: int | None = Field(default=None, ge=1)
    publish_concurrency: int | None = Field(default=None, ge=0)
    publish_rate: float | None = Field(default=None, ge=0)
    publish_burst: int | None = Field(default=None, ge=1)


TierName = Annotated[str, StringConstraints(pattern=TIER_PATTERN)]


class FairShareSettings(BaseSettings):
    """``KB_FAIR_*``, read by ``kb serve``."""

    model_config = SettingsConfigDict(env_prefix="KB_FAIR_", frozen=True, extra="ignore")

    # Off: no cap, bucket or slot; every request goes straight through (as before).
    enabled: bool = True
    # Searches the process runs at once; more wait, handed a slot by tenant (0: no slots,
    # every admitted search runs at once). Unset: one per two CPUs this process may run
    # on, at least one -- a hybrid search keeps two cores busy (its two lists run at once,
    # the query model uses two threads).
    search_global_concurrency: int | None = Field(default=None, ge=0)
    # How long an admitted search waits for a slot (each time: a search that stepped aside
    # between its phases waits again) before it is answered 429 SEARCH_SLOT_WAIT_TIMEOUT with
    # Retry-After: a queue of searches nobody will wait for only delays the ones behind it.
    search_slot_wait_seconds: float = Field(default=5.0, gt=0, le=600)
    search_concurrency: int = Field(default=32, ge=0)
    search_rate: float = Field(default=0.0, ge=0)
    search_burst: int | None = Field(default=None, ge=1)
    publish_concurrency: int = Field(default=16, ge=0)
    publish_rate: float = Field(default=0.0, ge=0)
    publish_burst: int | None = Field(default=None, ge=1)
    # Per tier, JSON: {"free": {"search_rate": 5, "search_burst": 10}}.
    tiers: dict[TierName, TierLimits] = Field(default_factory=dict)
    # How long a tenant's tier is kept before it is read again.
    tier_cache_seconds: float = Field(default=60.0, ge=0)

    def search_slots(self) -> int:
        """The process's search slots (0: none)."""
        if self.search_global_concurrency is not None:
            return self.search_global_concurrency
        return max(1, usable_cores() // CPUS_PER_SEARCH)

    def limits(self, tier: str | None, kind: Kind) -> Limits:
        """``kind``'s limits for a tenant of ``tier`` (None: unknown, the flat settings)."""
        own = self.tiers.get(tier or "") or TierLimits()
        if kind is Kind.SEARCH:
            concurrency = _first(own.search_concurrency, self.search_concurrency)
            rate = _first(own.search_rate, self.search_rate)
            burst = _first(own.search_burst, self.search_burst)
        else:
            concurrency = _first(own.publish_concurrency, self.publish_concurrency)
            rate = _first(own.publish_rate, self.publish_rate)
            burst = _first(own.publish_burst, self.publish_burst)
        # Unset burst: one second of the rate, at least one request.
        return Limits(concurrency, rate, burst if burst is not None else max(1, round(rate)))


T = TypeVar("T")


def _first(own: T | None, flat: T) -> T:
    return own if own is not None else flat
