"""Where time-dependent queries get ``now``: the database's own clock in production.

Every time-dependent query takes ``coalesce($n::timestamptz, now())``; a ``Clock`` supplies
``$n``. Production passes ``None`` (one clock for every worker: PostgreSQL's); tests inject a
clock that moves only when told (tests/support/clock.py), so leases expire without sleeping.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime | None:
        """The time to use, or ``None`` for the database's own clock (production)."""
        ...


class DatabaseClock:
    """Production: every time-dependent query reads PostgreSQL's ``now()``."""

    def now(self) -> datetime | None:
        return None
