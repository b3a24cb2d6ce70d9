"""Search on streaming replicas (docs/scaling.md#search-on-replicas).

``KB_SEARCH_DATABASE_URLS`` names read replicas of the primary (``DATABASE_URL``). Searches
read them in turn; everything that writes stays on the primary.

**Lag.** Every ``KB_SEARCH_REPLICA_CHECK_SECONDS`` the rotation reads the primary's WAL insert
position, then each replica's replayed position (``pg_last_wal_replay_lsn()``), each read
bounded by that interval. A replica's
lag is how long ago the primary first had WAL the replica has not replayed yet: 0 when it has
replayed everything the primary had at the last check, else the age of the oldest check whose
position it has not reached. Unlike ``now() - pg_last_xact_replay_timestamp()`` this does not
grow while the primary is idle, and it counts a replica that receives WAL but does not apply
it (a paused replay, a replay held up by a conflicting query) as lagging. Its resolution is
the check interval. A replica lagging more than ``KB_SEARCH_REPLICA_MAX_LAG_SECONDS``, or one
that does not answer the check, leaves the rotation until a check finds it caught up; with
none left, search reads the primary. In a round that cannot read the primary (down, or its
pool busy past the interval) a replica's lag is not known: it is taken as the time since the
last round that read it (the most it can be for a replica that had replayed all the primary
had then), so a short blip keeps the replicas and a longer one takes them all out.

**Read-your-switch.** A search may name WAL positions (``after``: the ``searchToken`` of a
document's status, or of its ``DocumentSearchVersionSwitched`` event). It is answered only by
a server that has replayed the highest of them: a replica in rotation known to have, else it
waits up to ``KB_SEARCH_AFTER_WAIT_SECONDS`` for one (one poller reads the replicas' positions
every few milliseconds for all waiting searches), else it reads the primary. A replica's
replayed position only grows, so once it was seen at or past a token, every snapshot a search
takes there later sees the transaction the token was read after. A token no replica has
replayed is first compared with the primary's position (``primary_position.py``): one the
primary has not written is refused (422 ``SEARCH_TOKEN_AHEAD``) instead of waited for. The
choice and the wait come before the search takes its fair-share slot
(services/runtime/fair_share/phases.py): a waiting search holds none.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import asyncpg

from services.runtime.errors import ValidationFailed
from services.runtime.logging import get_logger
from services.runtime.tracing.spans import Attributes, annotate, span_under
from services.search.metrics import REPLICA_IN_ROTATION, REPLICA_LAG, SEARCH_READS, TOKEN_WAIT
from services.search.primary_position import READ_ERRORS, PrimaryPosition
from services.search.statements import SearchSettings

log = get_logger(__name__)

PRIMARY: Final = "primary"

# A WAL position as PostgreSQL prints a pg_lsn: two hexadecimal halves.
TOKEN_PATTERN: Final = r"^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$"
_TOKEN = re.compile(TOKEN_PATTERN)

# While searches wait for a position, how often the replicas' replayed positions are read.
_WAIT_POLL_SECONDS: Final = 0.005

# (On a replica) the position replayed; a server that is not in recovery (a primary named as
# a "replica") has replayed all it wrote.
_WAL_LAYOUT_SQL: Final = """SELECT max(setting::bigint) FILTER (WHERE name = 'wal_block_size'),
                                   max(setting::bigint) FILTER (WHERE name = 'wal_segment_size')
                              FROM pg_settings
                             WHERE name IN ('wal_block_size', 'wal_segment_size')"""
# WAL page headers: every page starts with a short one, a segment's first page with a long one.
_SHORT_PAGE_HEADER: Final = 24
_LONG_PAGE_HEADER: Final = 40
_REPLAYED_SQL: Final = """SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                                       ELSE pg_current_wal_insert_lsn() END
                                  - '0/0'::pg_lsn)::bigint"""


def parse_token(token: str) -> int:
    """A ``searchToken`` (``"16/B374D848"``) as a WAL byte position."""
    if not _TOKEN.match(token):
        raise ValidationFailed("a search token is a WAL position such as 16/B374D848")
    high, _, low = token.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def comparable(position: int, block_size: int = 8192, segment_size: int = 16 << 20) -> int:
    """An insert position as the end of the last record before it, the form a replica's
    replayed position takes. When the last record ends on a page boundary, PostgreSQL
    reports the insert position past the next page's header (``pg_switch_wal()`` on an idle
    primary: insert ``0/4000028``, replayed ``0/4000000`` for ever); compared as it is, a
    caught-up replica would never reach it. Nothing can end inside a page header, so the
    position just past one means the boundary."""
    if position % segment_size == _LONG_PAGE_HEADER:
        return position - _LONG_PAGE_HEADER
    if position % block_size == _SHORT_PAGE_HEADER:
        return position - _SHORT_PAGE_HEADER
    return position


def format_token(position: int) -> str:
    return f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"


def replica_name(url: str) -> str:
    """A replica's name in metrics, logs and the operator page: host:port/database, never
    its user or password."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    return f"{host}:{parts.port or 5432}{parts.path or '/'}"


@dataclass
class Replica:
    name: str
    pool: asyncpg.Pool[Any]
    in_rotation: bool = False  # until the first check has found it caught up
    replayed: int | None = None
    lag_seconds: float | None = None
    last_answer: float | None = None  # monotonic time of its last answer to a check
    error: str | None = None


@dataclass(frozen=True)
class ReplicaView:
    """A replica as the operator page shows it."""

    name: str
    in_rotation: bool
    lag_seconds: float | None
    error: str | None


@dataclass(frozen=True)
class ReadTarget:
    name: str
    pool: asyncpg.Pool[Any]
    waited_seconds: float = 0.0


class ReplicaRotation:
    """Which server a search reads, and the check that keeps the replicas' lag known."""

    def __init__(
        self,
        primary: asyncpg.Pool[Any],
        replicas: Sequence[tuple[str, asyncpg.Pool[Any]]],
        *,
        max_lag_seconds: float,
        after_wait_seconds: float,
        check_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._primary = primary
        # The primary's insert position: the lag check's, and what a token may name.
        self.primary = PrimaryPosition(primary, timeout_seconds=check_seconds)
        self.replicas = [Replica(name, pool) for name, pool in replicas]
        self._max_lag = max_lag_seconds
        self._after_wait = after_wait_seconds
        self._check_seconds = check_seconds
        self._clock = clock
        self._turn = itertools.count()
        # (time, primary position) of the recent checks, oldest first: long enough to tell
        # a lag past the limit.
        self._history: deque[tuple[float, int]] = deque(
            maxlen=max(8, int(4 * max_lag_seconds / check_seconds) + 2)
        )
        # The primary's WAL page and segment sizes (read at the first check; defaults before).
        self._block_size = 8192
        self._segment_size = 16 << 20
        self._layout_known = False
        self._waiting = 0
        self._moved = asyncio.Event()  # set (and replaced) whenever a replica moved forward
        self._poller: asyncio.Task[None] | None = None
        for replica in self.replicas:
            REPLICA_IN_ROTATION.labels(replica=replica.name).set(0)

    def views(self) -> list[ReplicaView]:
        return [ReplicaView(r.name, r.in_rotation, r.lag_seconds, r.error) for r in self.replicas]

    # --- choosing a server ---------------------------------------------------------------

    async def choose(self, after: int | None = None) -> ReadTarget:
        """The server a search reads: a replica in rotation (in turn) that has replayed
        ``after`` (waiting for one at most KB_SEARCH_AFTER_WAIT_SECONDS), else the primary.
        The choice is attributes of the current span (the request's), not a span of its own:
        a span would cost as much as choosing. A wait is a span (``kb.search.after_wait``)."""
        target = await self._choose(after)
        chosen: Attributes = {"kb.search.server": target.name, "kb.search.after": after is not None}
        if after is not None:
            chosen["kb.search.after_wait_seconds"] = target.waited_seconds
        annotate(chosen)
        return target

    async def _choose(self, after: int | None) -> ReadTarget:
        if after is None:
            target = self._next(self._rotation())
            return self._counted(target or ReadTarget(PRIMARY, self._primary))
        token = after
        after = comparable(after, self._block_size, self._segment_size)
        started = self._clock()
        target = self._next([r for r in self._rotation() if (r.replayed or -1) >= after])
        if target is None:
            # Nothing replayed it yet: refuse it if the primary never wrote it, rather than
            # wait for it (or read the primary, whose answer could not hold it either).
            await self.primary.check_written(token, format_token(token))
        if target is None and self._after_wait > 0 and self._rotation():
            with span_under("kb.search.after_wait", None):
                target = await self._wait_for(after, started + self._after_wait)
        waited = self._clock() - started
        TOKEN_WAIT.observe(waited)
        chosen = target or ReadTarget(PRIMARY, self._primary)
        return self._counted(ReadTarget(chosen.name, chosen.pool, waited))

    def next_replica(self) -> tuple[str, asyncpg.Pool[Any]] | None:
        """A replica in rotation, in turn, without waiting nor counting a search read: for
        the publisher's status reads (services/app.py; docs/scaling.md#status-on-replicas)."""
        target = self._next(self._rotation())
        return None if target is None else (target.name, target.pool)

    def _rotation(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.in_rotation]

    def _next(self, candidates: list[Replica]) -> ReadTarget | None:
        if not candidates:
            return None
        replica = candidates[next(self._turn) % len(candidates)]
        return ReadTarget(replica.name, replica.pool)

    @staticmethod
    def _counted(target: ReadTarget) -> ReadTarget:
        SEARCH_READS.labels(server=target.name).inc()
        return target

    async def _wait_for(self, after: int, deadline: float) -> ReadTarget | None:
        self._waiting += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_while_waited())
        try:
            while True:
                ready = [r for r in self._rotation() if (r.replayed or -1) >= after]
                if ready:
                    return self._next(ready)
                remaining = deadline - self._clock()
                if remaining <= 0 or not self._rotation():
                    return None
                moved = self._moved
                try:
                    await asyncio.wait_for(moved.wait(), remaining)
                except TimeoutError:
                    return None
        finally:
            self._waiting -= 1

    async def _poll_while_waited(self) -> None:
        while self._waiting > 0:
            await asyncio.gather(
                *(self._read_replayed(replica) for replica in self._rotation()),
            )
            moved, self._moved = self._moved, asyncio.Event()
            moved.set()
            await asyncio.sleep(_WAIT_POLL_SECONDS)

    async def _read_replayed(self, replica: Replica) -> None:
        try:
            position = await self._replayed(replica)
        except READ_ERRORS:
            return  # the next check judges it
        if position is None:
            return
        position = comparable(int(position), self._block_size, self._segment_size)
        if position > (replica.replayed or -1):
            replica.replayed = position

    async def _replayed(self, replica: Replica) -> int | None:
        # Bounded with the pool's acquire: a replica whose connections all run searches must
        # not hold up the check (it is judged as not answering).
        async with asyncio.timeout(self._check_seconds):
            position: int | None = await replica.pool.fetchval(_REPLAYED_SQL)
        return position

    # --- the lag check ---------------------------------------------------------------------

    async def check(self) -> None:
        """One round: the primary's position, then each replica's, their lag and rotation."""
        if not self._layout_known:
            await self._read_layout()
        position = await self.primary.read()
        if position is not None:
            comparable_position = comparable(position, self._block_size, self._segment_size)
            self._history.append((self._clock(), comparable_position))
        else:
            log.warning("search.replica_check_primary_unread", replicas=len(self.replicas))
        await asyncio.gather(
            *(self._check_replica(replica, position is not None) for replica in self.replicas)
        )

    async def _read_layout(self) -> None:
        try:
            async with asyncio.timeout(self._check_seconds):
                layout = await self._primary.fetchrow(_WAL_LAYOUT_SQL)
        except READ_ERRORS:
            return  # the defaults until a round reads it
        if layout is not None and None not in (layout[0], layout[1]):
            self._block_size, self._segment_size = int(layout[0]), int(layout[1])
        self._layout_known = True

    async def _check_replica(self, replica: Replica, primary_read: bool) -> None:
        now = self._clock()
        try:
            position = await self._replayed(replica)
        except READ_ERRORS as error:
            lag = None if replica.last_answer is None else now - replica.last_answer
            self._judge(replica, lag, error=f"{type(error).__name__}: {error}"[:300])
            return
        replica.last_answer = now
        if position is None:  # not a standby that streams or replays WAL (yet)
            self._judge(replica, None, error="no WAL replayed yet")
            return
        # A replica's replayed position is a record's end already; a primary listed as a
        # replica answers its insert position.
        replayed = comparable(int(position), self._block_size, self._segment_size)
        replica.replayed = max(replayed, replica.replayed or -1)
        lag = self._lag_of(replayed, now) if primary_read else self._lag_bound(replayed, now)
        self._judge(replica, lag, error=None)

    def _lag_of(self, replayed: int, now: float) -> float:
        for checked_at, position in self._history:
            if position > replayed:
                return max(0.0, now - checked_at)
        return 0.0

    def _lag_bound(self, replayed: int, now: float) -> float | None:
        """The lag in a round that could not read the primary: at most the time since the
        last round that did (the replica had replayed all the primary had then, or its lag
        is longer still); None when no round ever did."""
        if not self._history:
            return None
        return max(self._lag_of(replayed, now), now - self._history[-1][0])

    def _judge(self, replica: Replica, lag: float | None, *, error: str | None) -> None:
        replica.lag_seconds = lag
        replica.error = error
        if lag is not None:
            REPLICA_LAG.labels(replica=replica.name).set(lag)
        fit = error is None and lag is not None and lag <= self._max_lag
        if fit != replica.in_rotation:
            replica.in_rotation = fit
            log.warning(
                "search.replica_joined" if fit else "search.replica_left",
                replica=replica.name,
                lag_seconds=lag,
                max_lag_seconds=self._max_lag,
                error=error,
            )
        REPLICA_IN_ROTATION.labels(replica=replica.name).set(1 if fit else 0)

    async def run(self, stop: asyncio.Event) -> None:
        """Checks until ``stop`` is set; a failed round (the primary down) is logged."""
        while not stop.is_set():
            try:
                await self.check()
            except Exception as error:  # the check never takes the app down
                log.warning("search.replica_check_failed", error=f"{type(error).__name__}")
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._check_seconds)
        if self._poller is not None:
            await asyncio.gather(self._poller, return_exceptions=True)
        await self.primary.aclose()


@asynccontextmanager
async def replica_rotation(
    settings: SearchSettings, primary: asyncpg.Pool[Any]
) -> AsyncIterator[ReplicaRotation | None]:
    """The rotation over ``KB_SEARCH_DATABASE_URLS`` (None when it names none), its pools
    open and its lag check running, for the life of the app."""
    urls = settings.search_replica_urls
    if not urls:
        yield None
        return
    from services.search.connections import open_search_pool

    pools: list[tuple[str, asyncpg.Pool[Any]]] = []
    try:
        for url in urls:
            replica_settings = settings.model_copy(update={"database_url": url})
            # min_size 0: a replica that is down does not keep the app from starting; it
            # stays out of rotation until a check reaches it.
            pool = await open_search_pool(replica_settings, min_size=0)
            pools.append((replica_name(url), pool))
        rotation = ReplicaRotation(
            primary,
            pools,
            max_lag_seconds=settings.search_replica_max_lag_seconds,
            after_wait_seconds=settings.search_after_wait_seconds,
            check_seconds=settings.search_replica_check_seconds,
        )
        log.info("search.replicas", replicas=[name for name, _ in pools])
        stop = asyncio.Event()
        checking = asyncio.create_task(rotation.run(stop))
        try:
            yield rotation
        finally:
            stop.set()
            await checking
    finally:
        for _, pool in pools:
            await pool.close()
