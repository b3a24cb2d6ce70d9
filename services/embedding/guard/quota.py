"""The shared limiter's arithmetic: GCRA (the generic cell rate algorithm) with reservations.

Pure: no I/O, no clock. A store (``ports.ProviderStateStore``) keeps one theoretical arrival
time (``tat``) per bucket and runs ``reserve`` on it inside one transaction.

A bucket admits ``rate`` units per second with a burst of ``burst`` units: T = 1/rate is the
time one unit costs, tau = burst * T the tolerance. A request of cost c on buckets b1..bn is
sent at

    s = max(now, paused_until, max_b(max(tat_b, now) + c*T_b - tau_b))

and every bucket then owes ``tat_b = max(tat_b, s) + c*T_b``. The caller sleeps until ``s``:
each caller learns its own time at once, so there is no retry loop and no herd after a
window opens. A request costlier than a bucket's burst is admitted when the bucket is idle
(its tolerance is at least one request's cost), then the bucket owes its whole cost.

A caller that would wait longer than it may (``max_wait_seconds``) reserves nothing: it
fails (EMBEDDING_RATE_LIMITED, retry after ``s - now``) and leaves no debt behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

# Bucket names, as stored in embedding_quota_bucket.bucket.
REQUESTS = "requests"
TOKENS = "tokens"
INDEXING_REQUESTS = "indexing:requests"
INDEXING_TOKENS = "indexing:tokens"
_TENANT_PREFIX = "tenant:"
_TENANT_SUFFIX = ":tokens"


class Purpose(StrEnum):
    """What an embedding request is for: indexing takes a share of the quota, leaving the
    rest to queries (search), which take only the totals."""

    INDEX = "index"
    QUERY = "query"


@dataclass(frozen=True)
class Bucket:
    name: str
    rate: float  # units per second
    burst: float  # units that may go at once

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst > 0):
            raise ValueError(f"bucket {self.name}: rate and burst must be > 0")

    def cost_time(self, cost: float) -> timedelta:
        """c * T: how long ``cost`` units occupy the bucket."""
        return timedelta(seconds=cost / self.rate)

    def tolerance(self, cost: float = 0.0) -> timedelta:
        """tau, at least one request's cost (a request bigger than the burst still goes)."""
        return timedelta(seconds=max(self.burst, cost) / self.rate)


@dataclass(frozen=True)
class Charge:
    bucket: Bucket
    cost: float


@dataclass(frozen=True)
class Reservation:
    """The outcome of ``reserve``: when to send, and the new tats (empty when refused)."""

    now: datetime
    send_at: datetime
    granted: bool
    tats: Mapping[str, datetime] = field(default_factory=dict)

    @property
    def wait_seconds(self) -> float:
        return max(0.0, (self.send_at - self.now).total_seconds())


def send_time(
    now: datetime,
    paused_until: datetime | None,
    tats: Mapping[str, datetime],
    charges: Sequence[Charge],
) -> datetime:
    """``s``: the earliest time every bucket (and the provider's pause) admits the request."""
    earliest = now if paused_until is None else max(now, paused_until)
    for charge in charges:
        tat = max(tats.get(charge.bucket.name, now), now)
        allowed = tat + charge.bucket.cost_time(charge.cost) - charge.bucket.tolerance(charge.cost)
        earliest = max(earliest, allowed)
    return earliest


def reserve(
    now: datetime,
    paused_until: datetime | None,
    tats: Mapping[str, datetime],
    charges: Sequence[Charge],
    *,
    max_wait_seconds: float,
) -> Reservation:
    """A reservation for one request, or a refusal when it would wait past the limit."""
    send_at = send_time(now, paused_until, tats, charges)
    if (send_at - now).total_seconds() > max_wait_seconds:
        return Reservation(now, send_at, granted=False)
    owed = {
        charge.bucket.name: max(tats.get(charge.bucket.name, now), send_at)
        + charge.bucket.cost_time(charge.cost)
        for charge in charges
    }
    return Reservation(now, send_at, granted=True, tats=owed)


def paused_tats(
    tats: Mapping[str, datetime], paused_until: datetime, plan: QuotaPlan
) -> dict[str, datetime]:
    """After a Retry-After: every bucket the plan knows owes at least ``paused_until + tau``,
    so that when the pause ends requests resume one period apart, not as a burst. Buckets
    the plan does not know (another configuration's) are left alone."""
    moved: dict[str, datetime] = {}
    for name, tat in tats.items():
        bucket = plan.bucket(name)
        if bucket is not None:
            moved[name] = max(tat, paused_until + bucket.tolerance())
    return moved


def capped_tats(
    tats: Mapping[str, datetime], paused_until: datetime, plan: QuotaPlan
) -> dict[str, datetime]:
    """A pause cut short to ``paused_until`` (``ProviderStateStore.cap_pause``): the buckets
    the plan knows owe no more than ``paused_until + tau``; the others are left alone."""
    cut: dict[str, datetime] = {}
    for name, tat in tats.items():
        bucket = plan.bucket(name)
        if bucket is not None and tat > paused_until + bucket.tolerance():
            cut[name] = paused_until + bucket.tolerance()
    return cut


@dataclass(frozen=True)
class QuotaPlan:
    """The buckets of one provider, from the settings. A rate left ``None`` is no bucket;
    with no rate at all the limiter charges nothing (and costs no database round trip)."""

    requests_per_second: float | None = None
    tokens_per_second: float | None = None
    # The share of each rate indexing may not take: there is always room for queries.
    query_reserve: float = 0.05
    # Each tenant's share of the token rate (per-tenant bucket), None = off.
    tenant_share: float | None = None
    burst_seconds: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.query_reserve < 1:
            raise ValueError("query_reserve must be in [0, 1)")
        if self.tenant_share is not None and not 0 < self.tenant_share <= 1:
            raise ValueError("tenant_share must be in (0, 1]")
        if self.burst_seconds <= 0:
            raise ValueError("burst_seconds must be > 0")

    @property
    def meters_tokens(self) -> bool:
        """Whether a request's tokens are charged anywhere (a token rate is set)."""
        return self.tokens_per_second is not None

    @property
    def limits(self) -> bool:
        return self.requests_per_second is not None or self.tokens_per_second is not None

    def _bucket(self, name: str, rate: float | None) -> Bucket | None:
        # At least one unit of burst: one request always fits the requests bucket.
        return None if rate is None else Bucket(name, rate, max(1.0, rate * self.burst_seconds))

    def _indexing(self, rate: float | None) -> float | None:
        return None if rate is None or self.query_reserve == 0 else rate * (1 - self.query_reserve)

    def bucket(self, name: str) -> Bucket | None:
        """The bucket a stored name stands for under this plan (None: not one of ours)."""
        fixed = {
            REQUESTS: self.requests_per_second,
            TOKENS: self.tokens_per_second,
            INDEXING_REQUESTS: self._indexing(self.requests_per_second),
            INDEXING_TOKENS: self._indexing(self.tokens_per_second),
        }
        if name in fixed:
            return self._bucket(name, fixed[name])
        if name.startswith(_TENANT_PREFIX) and name.endswith(_TENANT_SUFFIX):
            return self._tenant_bucket(name)
        return None

    def _tenant_bucket(self, name: str) -> Bucket | None:
        if self.tenant_share is None or self.tokens_per_second is None:
            return None
        return self._bucket(name, self.tokens_per_second * self.tenant_share)

    def charges(self, purpose: Purpose, tokens: int) -> list[Charge]:
        """What one request of ``tokens`` tokens costs: the totals, and for indexing the
        indexing share as well."""
        names = [REQUESTS, TOKENS]
        if purpose is Purpose.INDEX:
            names += [INDEXING_REQUESTS, INDEXING_TOKENS]
        found: list[Charge] = []
        for name in names:
            bucket = self.bucket(name)
            cost = 1.0 if name in (REQUESTS, INDEXING_REQUESTS) else float(tokens)
            if bucket is not None and cost > 0:
                found.append(Charge(bucket, cost))
        return found

    def tenant_charge(self, tenant_id: str, tokens: int) -> Charge | None:
        """A task's texts against its tenant's share (None when shares are off)."""
        bucket = self._tenant_bucket(f"{_TENANT_PREFIX}{tenant_id}{_TENANT_SUFFIX}")
        return None if bucket is None or tokens <= 0 else Charge(bucket, float(tokens))
