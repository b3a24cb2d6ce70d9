"""Exponential backoff with a cap and jitter: the one delay rule every retry loop uses.

The n-th consecutive failure waits ``min(cap, base * 2 ** (n - 1))``, shortened by up to
``jitter`` of itself at random, so that workers which failed together do not come back
together. The random source is injectable, for tests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Past ~60 doublings every float is far above any sensible cap; stop before overflow.
_MAX_EXPONENT = 60


@dataclass(frozen=True)
class Backoff:
    base_seconds: float
    cap_seconds: float
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.base_seconds <= 0 or self.cap_seconds < self.base_seconds:
            raise ValueError("backoff needs 0 < base_seconds <= cap_seconds")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("backoff jitter must be within [0, 1]")

    def ceiling(self, failures: int) -> float:
        """The delay after ``failures`` failures in a row, before jitter."""
        exponent = min(max(0, failures - 1), _MAX_EXPONENT)
        return min(self.cap_seconds, self.base_seconds * math.pow(2.0, exponent))

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """The jittered delay after ``failures`` (>= 1) failures in a row."""
        draw = (rng or random).random()
        return self.ceiling(failures) * (1.0 - self.jitter * draw)
