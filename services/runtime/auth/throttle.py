"""Failed-authentication throttling per client address (docs/security.md#failed-keys).

Each address has a token bucket of failures: ``burst`` failed authentications (401s) in a
row, then ``per_minute`` more a minute. An address whose bucket is empty is answered 429
with Retry-After before its key is looked at, so guessing keys costs the database nothing
and gains at most ``per_minute`` tries a minute. The address is the request's peer as
uvicorn reports it, which is the forwarded client only behind ``KB_HTTP_TRUSTED_PROXIES``;
IPv6 addresses count per /64, the block one host is usually given. Memory is bounded: at
most ``max_addresses`` buckets, the least recently failed forgotten first. The buckets are
per process (each ``kb serve`` counts its own).
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from starlette.types import Scope

UNKNOWN_ADDRESS: Final = "unknown"


@dataclass
class _Bucket:
    tokens: float
    updated: float


class FailedAuthThrottle:
    def __init__(
        self,
        *,
        burst: int,
        per_minute: float,
        max_addresses: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = float(burst)
        self._rate = per_minute / 60.0
        self._max = max_addresses
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _refilled(self, address: str, now: float) -> _Bucket | None:
        bucket = self._buckets.get(address)
        if bucket is None:
            return None
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.updated) * self._rate)
        bucket.updated = now
        if bucket.tokens >= self._burst:  # full again: nothing worth remembering
            del self._buckets[address]
            return None
        return bucket

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or ``None`` when it may now."""
        bucket = self._refilled(address, self._clock())
        if bucket is None or bucket.tokens >= 1.0:
            return None
        return (1.0 - bucket.tokens) / self._rate

    def record_failure(self, address: str) -> bool:
        """Count a failure; ``True`` when it is the one that empties the bucket (the
        address is throttled from now on)."""
        now = self._clock()
        bucket = self._refilled(address, now)
        if bucket is None:
            bucket = _Bucket(tokens=self._burst, updated=now)
            self._buckets[address] = bucket
        had_a_try = bucket.tokens >= 1.0
        bucket.tokens = max(0.0, bucket.tokens - 1.0)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return had_a_try and bucket.tokens < 1.0


def client_address(scope: Scope) -> str:
    """Whom a request's failures are counted against: its peer's IPv4 address, or its
    IPv6 address's /64."""
    client = scope.get("client")
    if not client:
        return UNKNOWN_ADDRESS
    host = str(client[0])
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:100]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
