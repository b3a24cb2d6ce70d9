"""The provider state in PostgreSQL (migration 0019): what every process of every host
shares. Named queries in ``guard.sql``; the arithmetic is ``quota``'s and ``breaker``'s,
run here on rows this transaction holds locked.

Each step is one short transaction that locks rows in key order -- the provider's row
before its buckets, buckets in name order -- reads them, computes, writes, commits; never
a lock held across a request to the provider or a sleep (see guard.sql). A reservation
costs five statements (BEGIN, lock, read, write, COMMIT); rows are created once per
process and bucket, outside these transactions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from services.embedding.guard.breaker import Breaker, BreakerPolicy, BreakerState
from services.embedding.guard.ports import ProbeTaken, ProviderView
from services.embedding.guard.quota import (
    Charge,
    QuotaPlan,
    Reservation,
    capped_tats,
    paused_tats,
    reserve,
)
from services.runtime.pg.clock import Clock, DatabaseClock
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

QUERIES = queries_beside(__file__, "guard.sql")


class PgProviderStateStore:
    def __init__(self, pool: asyncpg.Pool[Any], *, clock: Clock | None = None) -> None:
        self._pool = pool
        self._clock = clock or DatabaseClock()
        # (provider, bucket) rows this process knows exist: created once, then only locked.
        self._buckets: set[tuple[str, str]] = set()

    async def view(self, provider: str) -> ProviderView:
        with translate_db_errors():
            row = await self._pool.fetchrow(QUERIES["view_provider"], self._clock.now(), provider)
        assert row is not None
        return _view(provider, row)

    async def views(self) -> list[ProviderView]:
        """Every provider any process has used, as the shared state says now."""
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["list_providers"], self._clock.now())
        return [_view(row["provider"], row) for row in rows]

    async def reserve(
        self, provider: str, charges: Sequence[Charge], *, max_wait_seconds: float
    ) -> Reservation:
        names = sorted({charge.bucket.name for charge in charges})
        with translate_db_errors():
            for _ in range(2):
                await self._ensure_buckets(provider, names)
                try:
                    return await self._reserve(provider, names, charges, max_wait_seconds)
                except _BucketGone:
                    continue
        raise AssertionError(f"the quota buckets of {provider} keep disappearing")

    async def _reserve(
        self,
        provider: str,
        names: Sequence[str],
        charges: Sequence[Charge],
        max_wait_seconds: float,
    ) -> Reservation:
        async with self._pool.acquire() as conn, conn.transaction():
            tats = await self._lock(conn, QUERIES["lock_buckets"], provider, names)
            read = await conn.fetchrow(QUERIES["read_pause"], provider, self._clock.now())
            assert read is not None
            reservation = reserve(
                read["now"], read["paused_until"], tats, charges, max_wait_seconds=max_wait_seconds
            )
            if reservation.granted:
                await _write_tats(conn, provider, reservation.tats)
        return reservation

    async def pause(self, provider: str, *, seconds: float, plan: QuotaPlan) -> ProviderView:
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                row = await self._lock_provider(conn, provider)
                now: datetime = row["now"]
                until = now + timedelta(seconds=seconds)
                updated_at = row["updated_at"]
                if row["paused_until"] is not None and row["paused_until"] >= until:
                    until = row["paused_until"]
                else:
                    await conn.execute(QUERIES["write_pause"], provider, until, now)
                    updated_at = now
                tats = await self._lock(conn, QUERIES["lock_all_buckets"], provider, None)
                await _write_tats(conn, provider, paused_tats(tats, until, plan))
        return ProviderView(provider, now, until, _breaker(row), updated_at)

    async def cap_pause(
        self, provider: str, *, max_seconds: float, plan: QuotaPlan
    ) -> ProviderView:
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                row = await self._lock_provider(conn, provider)
                now: datetime = row["now"]
                until = now + timedelta(seconds=max_seconds)
                paused_until, updated_at = row["paused_until"], row["updated_at"]
                if paused_until is not None and paused_until > until:
                    await conn.execute(QUERIES["write_pause"], provider, until, now)
                    paused_until, updated_at = until, now
                tats = await self._lock(conn, QUERIES["lock_all_buckets"], provider, None)
                await _write_tats(conn, provider, capped_tats(tats, until, plan))
        return ProviderView(provider, now, paused_until, _breaker(row), updated_at)

    async def take_probe(self, provider: str, *, owner: str, policy: BreakerPolicy) -> ProbeTaken:
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                row = await self._lock_provider(conn, provider)
                breaker = _breaker(row)
                probing = breaker.take_probe(owner, row["now"], policy)
                if probing is not None and probing != breaker:
                    await _write_breaker(conn, provider, probing, row["now"])
                    return ProbeTaken(_view(provider, row, breaker=probing, written=True), True)
        return ProbeTaken(_view(provider, row, breaker=probing), probing is not None)

    async def record_failure(
        self, provider: str, *, code: str, probe_owner: str | None, policy: BreakerPolicy
    ) -> ProviderView:
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                row = await self._lock_provider(conn, provider)
                failed = _breaker(row).failed(code, row["now"], policy, probe_owner=probe_owner)
                await _write_breaker(conn, provider, failed, row["now"])
        return _view(provider, row, breaker=failed, written=True)

    async def record_success(self, provider: str) -> ProviderView:
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                row = await self._lock_provider(conn, provider)
                breaker = _breaker(row)
                closed = breaker.succeeded(row["now"])
                await _write_breaker(conn, provider, closed, row["now"])
        return _view(provider, row, breaker=closed, written=True)

    # --- rows -------------------------------------------------------------------------------

    async def _ensure_buckets(self, provider: str, names: Sequence[str]) -> None:
        missing = [name for name in names if (provider, name) not in self._buckets]
        if missing:
            await self._pool.execute(
                QUERIES["ensure_buckets"], provider, missing, self._clock.now()
            )
            self._buckets.update((provider, name) for name in missing)

    async def _lock(
        self, conn: Transaction, query: str, provider: str, names: Sequence[str] | None
    ) -> dict[str, datetime]:
        args = (provider,) if names is None else (provider, list(names))
        rows = await conn.fetch(query, *args)
        tats: dict[str, datetime] = {row["bucket"]: row["tat"] for row in rows}
        if names is not None and len(tats) < len(names):
            # A row this process created has gone (deleted by hand): create it again and
            # retry, rather than reserve on a bucket no lock protects.
            self._buckets.difference_update((provider, name) for name in names)
            raise _BucketGone
        return tats

    async def _lock_provider(self, conn: Transaction, provider: str) -> Mapping[str, Any]:
        # First in its transaction: the insert holds no key out of order (guard.sql).
        await conn.execute(QUERIES["ensure_provider"], provider, self._clock.now())
        row = await conn.fetchrow(QUERIES["lock_provider"], self._clock.now(), provider)
        assert row is not None
        row_: Mapping[str, Any] = row
        return row_


class _BucketGone(Exception):
    pass


async def _write_tats(conn: Transaction, provider: str, tats: Mapping[str, datetime]) -> None:
    if tats:
        names = sorted(tats)
        await conn.execute(
            QUERIES["write_buckets"], provider, names, [tats[name] for name in names]
        )


async def _write_breaker(conn: Transaction, provider: str, breaker: Breaker, now: datetime) -> None:
    await conn.execute(
        QUERIES["write_breaker"],
        provider,
        str(breaker.state),
        breaker.consecutive_failures,
        breaker.opened_at,
        breaker.open_until,
        breaker.probe_owner,
        breaker.probe_until,
        breaker.last_failure_code,
        breaker.last_success_at,
        now,
    )


def _breaker(row: Mapping[str, Any]) -> Breaker:
    if row["breaker_state"] is None:
        return Breaker()
    return Breaker(
        state=BreakerState(row["breaker_state"]),
        consecutive_failures=row["consecutive_failures"],
        opened_at=row["opened_at"],
        open_until=row["open_until"],
        probe_owner=row["probe_owner"],
        probe_until=row["probe_until"],
        last_failure_code=row["last_failure_code"],
        last_success_at=row["last_success_at"],
    )


def _view(
    provider: str, row: Mapping[str, Any], *, breaker: Breaker | None = None, written: bool = False
) -> ProviderView:
    """The view of a row as read, or (``written``) as this transaction left it."""
    return ProviderView(
        provider=provider,
        now=row["now"],
        paused_until=row["paused_until"],
        breaker=breaker or _breaker(row),
        updated_at=row["now"] if written else row["updated_at"],
    )
