"""Failed-authentication throttling per client (docs/security.md#failed-keys).

Each client has a token bucket of failures: ``burst`` failed authentications (401s) in a
row, then ``per_minute`` more a minute. A try is reserved before the key is looked at and
given back when the key turns out good, so however many requests one client sends at once,
at most as many lookups as it has tries left are in flight: concurrent bad keys cannot all
reach the database. A request that finds its client's tries all reserved by lookups still
running waits for them (a good client's concurrency is never refused); a client with no
try left is answered 429 with Retry-After before its key is looked at.

The client is the request's peer as uvicorn reports it (the forwarded client only behind
``KB_HTTP_TRUSTED_PROXIES``): an IPv4 address, or an IPv6 address's ``/ipv6_prefix`` (/64,
the block one host is usually given). Because one attacker may hold a whole IPv6 /48 (65,536
/64s), each IPv6 client is also counted in its ``/ipv6_network_prefix``, whose bucket holds
``network_multiple`` times a client's. That count holds back only a client that has failed
itself (its own bucket holds failures): a clean /64 is never refused for its neighbours, so
one customer cannot lock the rest of its /48 out. Once the network's tries are spent, a
fresh /64 has one lookup at a time until its first failure, and is refused after it: cycling
through the /64s of one /48 buys ``network_multiple`` bursts, then one try per fresh /64.

Memory is bounded: at most ``max_addresses`` buckets with failures in them. When a new one
would go beyond that, the bucket that would be full again (and so forgotten anyway) soonest
is forgotten first. An attacker cycling through fresh addresses thus only ever pushes out
buckets that hold fewer failures than its own, never a throttled client that failed more.
The buckets are per process (each ``kb serve`` counts its own).
"""

from __future__ import annotations

import asyncio
import heapq
import ipaddress
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from starlette.types import Scope

if TYPE_CHECKING:
    from services.runtime.auth.settings import AuthSettings

UNKNOWN_ADDRESS: Final = "unknown"


@dataclass
class _Bucket:
    capacity: float
    rate: float  # tries earned back per second
    tokens: float
    updated: float
    pending: int = 0  # tries reserved by lookups still running
    full_at: float | None = None  # when it refills, as last computed (None: never failed)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass(frozen=True)
class Refused:
    """No try left: answer 429 and retry after this many seconds."""

    retry_after: float


class Reservation:
    """One reserved try: resolve it with :meth:`failed` or :meth:`release` (once; later calls
    do nothing)."""

    def __init__(self, throttle: FailedAuthThrottle, keys: tuple[str, ...]) -> None:
        self._throttle = throttle
        self._keys = keys
        self._open = True

    def failed(self) -> bool:
        """The key was wrong: the try is spent. ``True`` when that left the client without
        a try (it is throttled from now on)."""
        if not self._open:
            return False
        self._open = False
        return self._throttle._resolve(self._keys, failed=True)

    def release(self) -> None:
        """The key was good (or no answer came): the try is given back."""
        if self._open:
            self._open = False
            self._throttle._resolve(self._keys, failed=False)


class FailedAuthThrottle:
    def __init__(
        self,
        *,
        burst: int,
        per_minute: float,
        max_addresses: int,
        ipv6_prefix: int = 64,
        ipv6_network_prefix: int = 48,
        network_multiple: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = float(burst)
        self._rate = per_minute / 60.0
        self._max = max_addresses
        self._ipv6_prefix = ipv6_prefix
        self._ipv6_network_prefix = ipv6_network_prefix
        self._multiple = network_multiple
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        # (full_at, order, key) of every bucket with failures; stale rows are skipped.
        self._refills: list[tuple[float, int, str]] = []
        self._order = itertools.count()
        self.waiting = 0  # requests waiting for a try reserved by a running lookup

    @classmethod
    def from_settings(
        cls, settings: AuthSettings, *, burst: int | None = None, per_minute: float | None = None
    ) -> FailedAuthThrottle:
        """The throttle ``settings`` describe (``burst`` / ``per_minute``: another allowance
        with the same addressing, as the operator sign-in's)."""
        return cls(
            burst=settings.failed_auth_burst if burst is None else burst,
            per_minute=settings.failed_auth_per_minute if per_minute is None else per_minute,
            max_addresses=settings.failed_auth_tracked_addresses,
            ipv6_prefix=settings.failed_auth_ipv6_prefix,
            ipv6_network_prefix=settings.failed_auth_ipv6_network_prefix,
            network_multiple=settings.failed_auth_ipv6_network_multiple,
        )

    def __len__(self) -> int:
        return len(self._buckets)

    def keys(self, host: str) -> tuple[str, ...]:
        """Whom a failure of ``host`` counts against: the client, then its IPv6 network."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return (host[:100] or UNKNOWN_ADDRESS,)
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is not None:
                return (str(address.ipv4_mapped),)
            client = str(ipaddress.IPv6Network((address, self._ipv6_prefix), strict=False))
            if self._ipv6_network_prefix >= self._ipv6_prefix:
                return (client,)
            network = ipaddress.IPv6Network((address, self._ipv6_network_prefix), strict=False)
            return (client, str(network))
        return (str(address),)

    def address(self, host: str) -> str:
        """The client ``host`` is counted as (for logs)."""
        return self.keys(host)[0]

    def _is_network(self, key: str, keys: tuple[str, ...]) -> bool:
        return len(keys) > 1 and key == keys[-1]

    def _bucket(self, key: str, now: float) -> _Bucket | None:
        bucket = self._buckets.get(key)
        if bucket is None:
            return None
        bucket.refill(now)
        if bucket.tokens >= bucket.capacity and bucket.pending == 0:
            del self._buckets[key]  # full again: nothing worth remembering
            return None
        return bucket

    def _new_bucket(self, key: str, keys: tuple[str, ...], now: float) -> _Bucket:
        multiple = self._multiple if self._is_network(key, keys) else 1
        bucket = _Bucket(self._burst * multiple, self._rate * multiple, self._burst * multiple, now)
        self._buckets[key] = bucket
        return bucket

    def _held_against(self, keys: tuple[str, ...], now: float) -> list[_Bucket | None]:
        """The buckets of ``keys`` that can hold the client back: its own, and its network's
        only once it has failed itself (a clean client is not answerable for neighbours)."""
        client = self._bucket(keys[0], now)
        if client is None or client.tokens >= client.capacity:
            return [client]
        return [client, *(self._bucket(key, now) for key in keys[1:])]

    def retry_after(self, host: str) -> float | None:
        """Seconds until ``host`` may try again, or ``None`` when it may now."""
        waits = [
            (1.0 - bucket.tokens) / bucket.rate
            for bucket in self._held_against(self.keys(host), self._clock())
            if bucket is not None and bucket.tokens < 1.0
        ]
        return max(waits) if waits else None

    def _busy(self, keys: tuple[str, ...], now: float) -> _Bucket | None:
        """The bucket whose running lookups hold every try ``keys[0]`` may use now."""
        held = self._held_against(keys, now)
        busy = next((b for b in held if b is not None and b.tokens - b.pending < 1.0), None)
        if busy is not None or len(held) == len(keys):
            return busy
        # A clean client while its network's tries are all spent or held: one lookup at a
        # time, so that concurrent keys from a fresh /64 are one try, not a burst.
        client = held[0]
        for key in keys[1:]:
            network = self._bucket(key, now)
            if network is not None and network.tokens - network.pending < 1.0:
                return client if client is not None and client.pending else None
        return None

    async def reserve(self, host: str) -> Reservation | Refused:
        """A try for ``host``'s next lookup, or :class:`Refused` when it has none left.
        Waits while every try it has left is reserved by a lookup still running."""
        keys = self.keys(host)
        while True:
            wait = self.retry_after(host)
            if wait is not None:
                return Refused(wait)
            now = self._clock()
            busy = self._busy(keys, now)
            if busy is None:
                buckets = [self._bucket(key, now) for key in keys]
                for key, bucket in zip(keys, buckets, strict=True):
                    (bucket or self._new_bucket(key, keys, now)).pending += 1
                return Reservation(self, keys)
            changed = busy.changed
            self.waiting += 1
            try:
                await changed.wait()
            finally:
                self.waiting -= 1

    def record_failure(self, host: str) -> bool:
        """Count a failure no try was reserved for (a route's 401, after the key passed);
        ``True`` when it left the client without a try."""
        now = self._clock()
        keys = self.keys(host)
        emptied = False
        for key in keys:
            bucket = self._bucket(key, now) or self._new_bucket(key, keys, now)
            emptied |= self._spend(key, bucket)
        self._forget_beyond_the_bound()
        return emptied

    def _resolve(self, keys: tuple[str, ...], *, failed: bool) -> bool:
        now = self._clock()
        emptied = False
        for key in keys:
            bucket = self._buckets.get(key)
            if bucket is None:  # cannot happen: a bucket with a reservation stays
                continue
            bucket.refill(now)
            bucket.pending -= 1
            if failed:
                emptied |= self._spend(key, bucket)
            elif bucket.pending == 0 and bucket.tokens >= bucket.capacity:
                del self._buckets[key]
            bucket.wake()
        if failed:
            self._forget_beyond_the_bound()
        return emptied

    def _spend(self, key: str, bucket: _Bucket) -> bool:
        had_a_try = bucket.tokens >= 1.0
        bucket.tokens = max(0.0, bucket.tokens - 1.0)
        # Refilling is linear, so the time it is full again stays right until it next fails.
        bucket.full_at = bucket.updated + (bucket.capacity - bucket.tokens) / bucket.rate
        heapq.heappush(self._refills, (bucket.full_at, next(self._order), key))
        return had_a_try and bucket.tokens < 1.0

    def _forget_beyond_the_bound(self) -> None:
        held: list[tuple[float, int, str]] = []
        while len(self._buckets) > self._max and self._refills:
            row = heapq.heappop(self._refills)
            full_at, _, key = row
            bucket = self._buckets.get(key)
            if bucket is None or bucket.full_at != full_at:
                continue  # forgotten already, or failed again since (a later row holds it)
            if bucket.pending:  # a running lookup resolves it: keep it until then
                held.append(row)
                continue
            del self._buckets[key]
        for row in held:
            heapq.heappush(self._refills, row)
        if len(self._refills) > 2 * len(self._buckets) + 64:
            self._refills = [
                (b.full_at, next(self._order), k)
                for k, b in self._buckets.items()
                if b.full_at is not None
            ]
            heapq.heapify(self._refills)


def peer_host(scope: Scope) -> str:
    """The request's peer address as the server reports it."""
    client = scope.get("client")
    return str(client[0]) if client else UNKNOWN_ADDRESS


def client_address(scope: Scope, ipv6_prefix: int = 64) -> str:
    """Whom a request's failures are counted against: its peer's IPv4 address, or its
    IPv6 address's /``ipv6_prefix``."""
    throttle = FailedAuthThrottle(
        burst=1,
        per_minute=1.0,
        max_addresses=1,
        ipv6_prefix=ipv6_prefix,
        ipv6_network_prefix=ipv6_prefix,
    )
    return throttle.address(peer_host(scope))
