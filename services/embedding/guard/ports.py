"""Where the guard's shared state lives: one row per provider (pause and breaker), one per
quota bucket. PostgreSQL in production (``store_pg``), memory in tests and single-process
runs (``store_memory``); one contract suite holds both to the same behaviour
(tests/contract/test_provider_guard_contract.py).

Every method is one atomic step on the shared state, its time the store's ``now`` (the
database clock in production, an injected one in tests), and returns what it left behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from services.embedding.guard.breaker import Breaker, BreakerPolicy, BreakerState
from services.embedding.guard.quota import Charge, QuotaPlan, Reservation


@dataclass(frozen=True)
class ProviderView:
    """One provider's shared state as read at ``now``: for the guard's decisions, the
    breaker gauge, the operator page and ``kb tasks list``."""

    provider: str
    now: datetime
    paused_until: datetime | None = None
    breaker: Breaker = field(default_factory=Breaker)
    updated_at: datetime | None = None

    @property
    def state(self) -> BreakerState:
        return self.breaker.state

    @property
    def consecutive_failures(self) -> int:
        return self.breaker.consecutive_failures

    @property
    def open_until(self) -> datetime | None:
        return self.breaker.open_until

    @property
    def probe_owner(self) -> str | None:
        return self.breaker.probe_owner

    @property
    def probe_until(self) -> datetime | None:
        return self.breaker.probe_until

    @property
    def paused(self) -> bool:
        return self.paused_until is not None and self.paused_until > self.now

    def seconds_until(self, when: datetime | None) -> float:
        return 0.0 if when is None else max(0.0, (when - self.now).total_seconds())

    def summary(self) -> str:
        """One line for an operator: the breaker, the failures behind it, a pause."""
        state = self.state
        if state is BreakerState.OPEN:
            due = self.seconds_until(self.open_until)
            text = (
                f"breaker OPEN, next probe in {due:.0f} s"
                if due > 0
                else "breaker OPEN, a probe is due"
            )
        elif state is BreakerState.HALF_OPEN:
            text = f"breaker HALF-OPEN, probe out ({self.probe_owner})"
        else:
            text = "breaker closed"
        if self.consecutive_failures:
            text += f", {self.consecutive_failures} failures in a row"
            if self.breaker.last_failure_code:
                text += f" (last {self.breaker.last_failure_code})"
        if self.paused:
            text += f", paused {self.seconds_until(self.paused_until):.0f} s more (Retry-After)"
        return text


@dataclass(frozen=True)
class ProbeTaken:
    view: ProviderView
    won: bool


class ProviderStateStore(Protocol):
    async def view(self, provider: str) -> ProviderView:
        """The provider's state now (closed, unpaused for a provider never seen)."""
        ...

    async def reserve(
        self, provider: str, charges: Sequence[Charge], *, max_wait_seconds: float
    ) -> Reservation:
        """``quota.reserve`` on the buckets charged, atomically: granted, the buckets owe
        the request; refused (it would wait more than ``max_wait_seconds``), nothing changes.
        Honours the provider's pause."""
        ...

    async def pause(self, provider: str, *, seconds: float, plan: QuotaPlan) -> ProviderView:
        """A Retry-After: ``paused_until`` at least ``now + seconds`` (never earlier than
        it was), and every bucket the plan knows moved past it (``quota.paused_tats``)."""
        ...

    async def cap_pause(
        self, provider: str, *, max_seconds: float, plan: QuotaPlan
    ) -> ProviderView:
        """``paused_until`` no later than ``now + max_seconds`` (a pause written before the
        cap existed, or under a larger one), and the buckets the plan knows owing no more
        than that (``quota.capped_tats``)."""
        ...

    async def take_probe(self, provider: str, *, owner: str, policy: BreakerPolicy) -> ProbeTaken:
        """``Breaker.take_probe`` for ``owner``: at most one caller wins a probe."""
        ...

    async def record_failure(
        self, provider: str, *, code: str, probe_owner: str | None, policy: BreakerPolicy
    ) -> ProviderView:
        """``Breaker.failed``: counted; opens at the threshold; a failed probe reopens."""
        ...

    async def record_success(self, provider: str) -> ProviderView:
        """``Breaker.succeeded``: closed, the count reset."""
        ...
