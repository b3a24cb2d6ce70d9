"""A clock for tests: a time that moves only when told, so lease expiry needs no sleeping.

It implements services.runtime.pg.clock.Clock; every time-dependent query takes its ``now``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class ManualClock:
    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime.now(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> datetime:
        self._now += timedelta(seconds=seconds)
        return self._now

    def set(self, when: datetime) -> None:
        self._now = when


class SecondsClock:
    """A monotonic clock in seconds (as ``time.monotonic``) that moves only when ``now`` is set."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
