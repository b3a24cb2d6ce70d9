"""One limiter and one circuit breaker per embedding provider, shared by every worker of
every process through a ``ProviderStateStore`` (PostgreSQL in production).

The indexer asks ``claim_allowance`` before it claims tasks (none while the breaker is
open or the provider paused: the tasks stay due, no attempt is spent; one claim to probe);
every request goes through ``before_request`` (the breaker, then a limiter reservation:
sleep until the send time, or fail EMBEDDING_RATE_LIMITED when that is too far) and
``after_request`` (a 429 pauses the provider for every process; provider failures count
towards opening the breaker; an answer closes it). ``GuardedEmbedder`` does the last two
around any ``Embedder``.

The shared pause is capped (``max_pause_seconds``): one 429 must not stop every indexer's
claims and every hybrid search for as long as it asks -- a Retry-After of a year would,
until someone edited the row. A Retry-After beyond the cap opens the breaker instead (a
failed probe's 429 reopens it), which probes after its open time as for an outage: a
provider that recovers is used again on its own. A longer pause found in the shared state
(written before the cap, or under a larger one) is cut to the cap when read.

The breaker and the pause are read from a copy of the shared state at most
``refresh_seconds`` old: a request that finds the breaker closed costs no round trip for
it, and a success writes only when the copy shows something to reset. The limiter costs
one short transaction per request while a rate is set, none otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import datetime

from services.embedding.guard.breaker import BREAKER_FAILURE_CODES, BreakerPolicy, BreakerState
from services.embedding.guard.metrics import (
    BREAKER_GAUGE,
    BREAKER_STATE,
    LIMITER_WAIT,
    REQUESTS,
    RETRY_AFTER_CAPPED,
    SHORT_CIRCUITED,
    result_of,
)
from services.embedding.guard.ports import ProbeTaken, ProviderStateStore, ProviderView
from services.embedding.guard.quota import Charge, Purpose, QuotaPlan
from services.runtime.errors import DependencyUnavailable, SerializationConflict
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from services.runtime.logging import get_logger

__all__ = ["ClaimAllowance", "GuardTiming", "ProviderGuard", "ProviderView", "Purpose"]

_log = get_logger(__name__)

# Set by before_request when the request is the breaker's probe (to the probe's owner),
# read by after_request: both run in the caller's task, so in its context.
_PROBE: ContextVar[str | None] = ContextVar("kb_embedding_probe", default=None)


@dataclass(frozen=True)
class ClaimAllowance:
    """How many tasks needing the provider a worker may claim now: ``None`` no limit,
    0 none (retry in ``retry_in_seconds``), 1 the probe's claim. ``reason``:
    ``breaker_open``, ``paused`` or ``probing``."""

    limit: int | None
    retry_in_seconds: float | None = None
    reason: str | None = None


@dataclass(frozen=True)
class GuardTiming:
    max_wait_seconds: float = 30.0  # an indexing request's longest wait for the limiter
    query_max_wait_seconds: float = 1.0  # a query's
    default_pause_seconds: float = 1.0  # after a 429 without Retry-After
    refresh_seconds: float = 0.5  # the oldest copy of the shared state used
    max_pause_seconds: float = 300.0  # the longest shared pause; a longer Retry-After opens


@dataclass(frozen=True)
class GuardRules:
    """What a provider's guard enforces, all from its settings (``factory.build_guard``):
    the quota's buckets, when the breaker opens, and how long callers wait."""

    plan: QuotaPlan = field(default_factory=QuotaPlan)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    timing: GuardTiming = field(default_factory=GuardTiming)


class ProviderGuard:
    def __init__(
        self,
        provider: str,
        store: ProviderStateStore,
        *,
        rules: GuardRules | None = None,
        owner: str = "",
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        rules = rules or GuardRules()
        self.provider = provider
        self.owner = owner  # this process, for logs
        self._store = store
        self._plan = rules.plan
        self._policy = rules.breaker
        self._timing = rules.timing
        self._sleep = sleep
        self._monotonic = monotonic
        self._view: ProviderView | None = None
        self._read_at = 0.0
        self._refreshing = asyncio.Lock()
        # Owners this guard won the probe for, and whether the probe request is out: one
        # probe request per process at a time, whichever of its owners took the probe.
        self._probe_holders: set[str] = set()
        self._probe_in_flight = False

    @property
    def meters_tokens(self) -> bool:
        """Whether ``before_request`` needs a request's token count (a token rate is set)."""
        return self._plan.meters_tokens

    # --- the shared state, as this process sees it --------------------------------------------

    async def view(self) -> ProviderView:
        """The provider's shared state, read now (and the breaker gauge set from it). A
        pause longer than the cap (written before it existed, or under a larger one) is cut
        to it: nobody has to edit the row."""
        view = await self._store.view(self.provider)
        cap = self._timing.max_pause_seconds
        if view.seconds_until(view.paused_until) > cap:
            was = view.paused_until
            view = await self._store.cap_pause(self.provider, max_seconds=cap, plan=self._plan)
            _log.warning(
                "embedding.pause_capped",
                provider=self.provider,
                was_paused_until=was.isoformat() if was else None,
                paused_until=view.paused_until.isoformat() if view.paused_until else None,
                max_pause_seconds=cap,
            )
        return self._remember(view)

    async def _current(self) -> ProviderView:
        """The copy, read again when older than ``refresh_seconds`` (once for everyone)."""
        if (fresh := self._fresh()) is not None:
            return fresh
        async with self._refreshing:
            return self._fresh() or await self.view()

    def _fresh(self) -> ProviderView | None:
        age = self._monotonic() - self._read_at
        return self._view if age < self._timing.refresh_seconds else None

    def _remember(self, view: ProviderView) -> ProviderView:
        self._view, self._read_at = view, self._monotonic()
        BREAKER_STATE.labels(self.provider).set(BREAKER_GAUGE[view.state])
        return view

    def _left(self, view: ProviderView, until: datetime | None) -> float:
        """Seconds from now (the view's time, plus what passed since it was read) to until."""
        elapsed = max(0.0, self._monotonic() - self._read_at)
        return max(0.0, view.seconds_until(until) - elapsed)

    def _holds_probe(self, view: ProviderView, owner: str) -> bool:
        return view.state is BreakerState.HALF_OPEN and (
            view.probe_owner == owner or view.probe_owner in self._probe_holders
        )

    async def _take_probe(self, owner: str) -> ProbeTaken:
        taken = await self._store.take_probe(self.provider, owner=owner, policy=self._policy)
        self._remember(taken.view)
        if taken.won:
            self._probe_holders.add(owner)
            _log.info("embedding.probe_taken", provider=self.provider, owner=owner)
        return taken

    # --- the indexer's claim gate ---------------------------------------------------------------

    async def claim_allowance(self, owner: str) -> ClaimAllowance:
        view = await self._current()
        if view.state is not BreakerState.CLOSED:
            if self._left(view, self._breaker_until(view)) == 0:
                taken = await self._take_probe(owner)
                if taken.won:
                    return ClaimAllowance(1, None, "probing")
                view = taken.view
            if view.state is BreakerState.OPEN:
                return ClaimAllowance(0, self._left(view, view.open_until), "breaker_open")
            if view.state is BreakerState.HALF_OPEN:
                return ClaimAllowance(0, min(self._left(view, view.probe_until), 1.0), "probing")
        if view.paused_until is not None and self._left(view, view.paused_until) > 0:
            return ClaimAllowance(0, self._left(view, view.paused_until), "paused")
        return ClaimAllowance(None)

    @staticmethod
    def _breaker_until(view: ProviderView) -> datetime | None:
        return view.open_until if view.state is BreakerState.OPEN else view.probe_until

    # --- around each request ----------------------------------------------------------------

    async def before_request(self, *, tokens: int, purpose: Purpose, owner: str) -> None:
        """Returns when the request may be sent (the breaker lets it through, the limiter's
        time has come); raises IndexingFailed when it may not: EMBEDDING_UNAVAILABLE with
        the breaker open, EMBEDDING_RATE_LIMITED when the wait would be too long."""
        view = await self._current()
        probe = await self._admit(view, owner, purpose)
        try:
            await self._wait_for_quota(self._plan.charges(purpose, tokens), purpose, "request")
        except BaseException:
            if probe is not None:
                self._probe_in_flight = False
            raise
        _PROBE.set(probe)

    async def _admit(self, view: ProviderView, owner: str, purpose: Purpose) -> str | None:
        """None: go (closed); an owner: go as that owner's probe; or short-circuit."""
        if view.state is BreakerState.CLOSED:
            return None
        due = self._left(view, self._breaker_until(view)) == 0
        if not due and self._holds_probe(view, owner) and not self._probe_in_flight:
            self._probe_in_flight = True
            return view.probe_owner
        if due:
            taken = await self._take_probe(owner)
            if taken.view.state is BreakerState.CLOSED:
                return None
            if taken.won and not self._probe_in_flight:
                self._probe_in_flight = True
                return owner
            view = taken.view
        raise self._short_circuit(view, purpose)

    def _short_circuit(self, view: ProviderView, purpose: Purpose) -> IndexingFailed:
        REQUESTS.labels(self.provider, purpose, SHORT_CIRCUITED).inc()
        if view.state is BreakerState.OPEN:
            wait, what = self._left(view, view.open_until), "open"
        else:
            wait, what = self._left(view, view.probe_until), "half open, another caller probing"
        return IndexingFailed(
            ErrorCode.EMBEDDING_UNAVAILABLE,
            f"embedding provider {self.provider} circuit {what} after "
            f"{view.consecutive_failures} consecutive failures "
            f"(last {view.breaker.last_failure_code}); not sent",
            retry_after_seconds=wait,
        )

    async def _wait_for_quota(self, charges: list[Charge], purpose: Purpose, what: str) -> None:
        query = purpose is Purpose.QUERY
        limit = self._timing.query_max_wait_seconds if query else self._timing.max_wait_seconds
        if charges:
            reservation = await self._store.reserve(self.provider, charges, max_wait_seconds=limit)
            wait, granted = reservation.wait_seconds, reservation.granted
        else:
            # No rate set: only a pause holds requests back, read from the copy.
            view = self._view
            wait = 0.0 if view is None else self._left(view, view.paused_until)
            granted = wait <= limit
        if not granted:
            if what == "request":
                REQUESTS.labels(self.provider, purpose, SHORT_CIRCUITED).inc()
            raise IndexingFailed(
                ErrorCode.EMBEDDING_RATE_LIMITED,
                f"embedding provider {self.provider}: the shared limiter would hold this "
                f"{purpose} {what} {wait:.1f}s, more than the {limit:g}s it may wait; not sent",
                retry_after_seconds=wait,
            )
        LIMITER_WAIT.labels(purpose).observe(wait)
        if wait > 0:
            await self._sleep(wait)

    async def after_request(
        self, *, owner: str, error: IndexingFailed | None, purpose: Purpose
    ) -> IndexingFailed | None:
        """What the request's outcome tells every process: a 429 pauses the provider (one
        asking for more than ``max_pause_seconds`` opens the breaker instead), a provider
        failure counts towards the breaker (a failed probe reopens it), any answer closes
        it. Returns the error to raise in place of ``error``, if any: a Retry-After beyond
        the cap is not waited for by the task either. A failure to write this down is
        logged, never raised: the request's own outcome matters more to the caller."""
        probe = _PROBE.get()
        _PROBE.set(None)
        if probe is not None:
            self._probe_in_flight = False
        REQUESTS.labels(self.provider, purpose, result_of(error)).inc()
        instead: IndexingFailed | None = None
        try:
            if error is not None and error.code in BREAKER_FAILURE_CODES:
                await self._failed(error.code, probe)
                return None
            if error is not None and error.code == ErrorCode.EMBEDDING_RATE_LIMITED:
                if not self._pausable(error.retry_after_seconds):
                    # Set first: the task must not wait a year because the write failed.
                    instead = self._capped(error, None)
                    instead = self._capped(error, await self._tripped(error, probe))
                    return instead
                await self._paused(error.retry_after_seconds)
            cached = self._view
            if probe is not None or cached is None or not cached.breaker.pristine:
                before = cached.state if cached is not None else None
                self._remember(await self._store.record_success(self.provider))
                if before is not BreakerState.CLOSED:
                    _log.info("embedding.breaker_closed", provider=self.provider, owner=owner)
        except (DependencyUnavailable, SerializationConflict) as trouble:
            _log.warning(
                "embedding.guard_write_failed",
                provider=self.provider,
                error_code=trouble.code,
                error=str(trouble),
            )
        return instead

    def _pausable(self, retry_after: float | None) -> bool:
        # NaN compares false with everything: "not <=" is beyond the cap.
        return retry_after is None or retry_after <= self._timing.max_pause_seconds

    async def _tripped(self, error: IndexingFailed, probe: str | None) -> ProviderView:
        """A Retry-After beyond the cap: the breaker opens at once (a probe's reopens for
        twice as long), whatever the count of failures."""
        at_once = replace(self._policy, failure_threshold=1)
        view = self._remember(
            await self._store.record_failure(
                self.provider, code=error.code, probe_owner=probe, policy=at_once
            )
        )
        RETRY_AFTER_CAPPED.labels(self.provider).inc()
        _log.warning(
            "embedding.retry_after_capped",
            provider=self.provider,
            retry_after_seconds=error.retry_after_seconds,
            max_pause_seconds=self._timing.max_pause_seconds,
            breaker_state=str(view.state),
            open_until=view.open_until.isoformat() if view.open_until else None,
            probe_failed=probe is not None,
        )
        return view

    def _capped(self, error: IndexingFailed, view: ProviderView | None) -> IndexingFailed:
        """``error`` with a Retry-After its task may wait for: until the breaker's probe
        (the cap when the breaker could not be read)."""
        wait = self._timing.max_pause_seconds
        if view is not None and view.state is BreakerState.OPEN:
            wait = self._left(view, view.open_until)
        return IndexingFailed(
            error.code,
            f"{error.message} (a Retry-After beyond the {self._timing.max_pause_seconds:g} s "
            "any pause may last: the breaker opened instead)",
            retry_after_seconds=wait,
        )

    async def _failed(self, code: str, probe: str | None) -> None:
        before = self._view.state if self._view is not None else None
        view = self._remember(
            await self._store.record_failure(
                self.provider, code=code, probe_owner=probe, policy=self._policy
            )
        )
        if view.state is BreakerState.OPEN and (probe is not None or before is not view.state):
            _log.warning(
                "embedding.breaker_opened",
                provider=self.provider,
                error_code=code,
                consecutive_failures=view.consecutive_failures,
                open_until=view.open_until.isoformat() if view.open_until else None,
                probe_failed=probe is not None,
            )

    async def _paused(self, retry_after: float | None) -> None:
        seconds = self._timing.default_pause_seconds if retry_after is None else retry_after
        seconds = min(seconds, self._timing.max_pause_seconds)
        view = self._remember(
            await self._store.pause(self.provider, seconds=seconds, plan=self._plan)
        )
        _log.info(
            "embedding.provider_paused",
            provider=self.provider,
            retry_after_seconds=seconds,
            paused_until=view.paused_until.isoformat() if view.paused_until else None,
        )

    def abandon_request(self) -> None:
        """The request between before_request and after_request was cancelled: its outcome
        is unknown and told to nobody, and a probe it carried may be sent again."""
        if _PROBE.get() is not None:
            self._probe_in_flight = False
        _PROBE.set(None)

    # --- per-tenant shares -----------------------------------------------------------------

    async def tenant_share(self, tenant_id: str, tokens: int) -> None:
        """Waits for the tenant's share of the token rate (a task's texts, before they join
        the request queue, where tenants mix); a no-op when shares are off."""
        charge = self._plan.tenant_charge(tenant_id, tokens)
        if charge is not None:
            await self._wait_for_quota([charge], Purpose.INDEX, "tenant's share")
