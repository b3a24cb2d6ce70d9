"""A token bucket: ``rate`` requests a second on average, ``burst`` at once after a quiet
spell. Time comes from the caller (a monotonic clock's seconds), so tests move it by hand."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    rate: float
    burst: int
    # Full when made: a tenant's first requests are never refused for a rate.
    tokens: float = field(init=False)
    updated: float

    def __post_init__(self) -> None:
        self.tokens = float(self.burst)

    def take(self, now: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one is there (nothing
        taken)."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def is_full(self, now: float) -> bool:
        """Full again: forgetting the bucket now loses nothing (a new one starts full)."""
        self._refill(now)
        return self.tokens >= self.burst

    def adjust(self, rate: float, burst: int) -> None:
        """The tier's limits changed: keep what the tenant has spent."""
        self.rate = rate
        self.burst = burst
        self.tokens = min(self.tokens, float(burst))

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
            self.updated = now
