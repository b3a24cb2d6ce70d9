"""The shared circuit breaker's state machine, per provider. Pure: a store runs these
transitions on the row it holds locked (``ports.ProviderStateStore``).

    closed --(failure_threshold consecutive provider failures, from any process)--> open
    open --(open_until passed; ONE caller takes the probe)--> half_open
    half_open --(the probe answers)--> closed
    half_open --(the probe fails)--> open, for twice as long (up to max_open_seconds)
    half_open --(probe_until passed: the probe's owner vanished)--> another caller probes

Provider failures are EMBEDDING_UNAVAILABLE, EMBEDDING_TIMEOUT and
EMBEDDING_RESPONSE_MALFORMED. A 429 is not one (the provider is up, only metered: the
limiter's pause handles it), nor is an answer the provider gave on purpose (a refused input,
an invalid answer): any such answer is a success for the breaker, and closes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

from services.runtime.indexing.index_failures import ErrorCode

BREAKER_FAILURE_CODES: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.EMBEDDING_UNAVAILABLE,
        ErrorCode.EMBEDDING_TIMEOUT,
        ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
    }
)


class BreakerState(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


@dataclass(frozen=True)
class BreakerPolicy:
    failure_threshold: int = 5
    open_seconds: float = 10.0
    max_open_seconds: float = 30.0
    probe_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if not 0 < self.open_seconds <= self.max_open_seconds:
            raise ValueError("open_seconds must be > 0 and <= max_open_seconds")
        if self.probe_seconds <= 0:
            raise ValueError("probe_seconds must be > 0")


@dataclass(frozen=True)
class Breaker:
    """One provider's breaker, as stored. ``opened_at``/``open_until`` stay while half open:
    a failed probe reopens for twice that span."""

    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    opened_at: datetime | None = None
    open_until: datetime | None = None
    probe_owner: str | None = None
    probe_until: datetime | None = None
    last_failure_code: str | None = None
    last_success_at: datetime | None = None

    @property
    def pristine(self) -> bool:
        """Closed with no failure counted: a success changes nothing (and writes nothing)."""
        return self.state is BreakerState.CLOSED and self.consecutive_failures == 0

    def probe_due(self, now: datetime) -> bool:
        """Whether a caller may take the probe now."""
        if self.state is BreakerState.OPEN:
            return self.open_until is None or self.open_until <= now
        if self.state is BreakerState.HALF_OPEN:
            return self.probe_until is None or self.probe_until <= now
        return False

    def failed(
        self, code: str, now: datetime, policy: BreakerPolicy, *, probe_owner: str | None = None
    ) -> Breaker:
        """A provider failure. ``probe_owner``: the request was the probe of that owner."""
        counted = replace(
            self, consecutive_failures=self.consecutive_failures + 1, last_failure_code=code
        )
        if (
            probe_owner is not None
            and self.state is BreakerState.HALF_OPEN
            and self.probe_owner == probe_owner
        ):
            return counted._opened(now, self._next_open_seconds(policy))
        if self.state is BreakerState.CLOSED and counted.consecutive_failures >= (
            policy.failure_threshold
        ):
            return counted._opened(now, policy.open_seconds)
        # Open already, or half open with someone else's probe (a request sent before the
        # breaker opened): counted, nothing else changes.
        return counted

    def succeeded(self, now: datetime) -> Breaker:
        """The provider answered: closed, the count reset."""
        return Breaker(last_failure_code=self.last_failure_code, last_success_at=now)

    def take_probe(self, owner: str, now: datetime, policy: BreakerPolicy) -> Breaker | None:
        """Half open with ``owner`` probing, if the probe is free now (None otherwise). The
        owner already probing keeps it (and its deadline)."""
        if self.state is BreakerState.HALF_OPEN and self.probe_owner == owner:
            return self if not self.probe_due(now) else self._probing(owner, now, policy)
        if not self.probe_due(now):
            return None
        return self._probing(owner, now, policy)

    def _probing(self, owner: str, now: datetime, policy: BreakerPolicy) -> Breaker:
        return replace(
            self,
            state=BreakerState.HALF_OPEN,
            probe_owner=owner,
            probe_until=now + timedelta(seconds=policy.probe_seconds),
        )

    def _opened(self, now: datetime, seconds: float) -> Breaker:
        return replace(
            self,
            state=BreakerState.OPEN,
            opened_at=now,
            open_until=now + timedelta(seconds=seconds),
            probe_owner=None,
            probe_until=None,
        )

    def _next_open_seconds(self, policy: BreakerPolicy) -> float:
        last = policy.open_seconds
        if self.opened_at is not None and self.open_until is not None:
            last = (self.open_until - self.opened_at).total_seconds()
        return min(max(2 * last, policy.open_seconds), policy.max_open_seconds)
