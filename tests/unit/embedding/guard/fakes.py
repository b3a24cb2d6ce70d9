"""What the guard's unit tests share: a memory store that counts its calls, a clock that
sleeping advances, and an inner embedder scripted with outcomes."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from services.embedding.guard.breaker import BreakerPolicy
from services.embedding.guard.guard import GuardRules, GuardTiming, ProviderGuard
from services.embedding.guard.ports import ProbeTaken, ProviderView
from services.embedding.guard.quota import Charge, QuotaPlan, Reservation
from services.embedding.guard.store_memory import InMemoryProviderStateStore
from services.embedding.port import FixedIdentity, Vectors
from services.embedding.tokens import TokenizerSpec
from tests.support.clock import ManualClock

START = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


class CountingStore(InMemoryProviderStateStore):
    """The memory store, counting each call: how many database round trips there would be."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls: Counter[str] = Counter()
        self.fail_with: Exception | None = None

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if self.fail_with is not None:
            raise self.fail_with

    async def view(self, provider: str) -> ProviderView:
        self._call("view")
        return await super().view(provider)

    async def reserve(
        self, provider: str, charges: Sequence[Charge], *, max_wait_seconds: float
    ) -> Reservation:
        self._call("reserve")
        return await super().reserve(provider, charges, max_wait_seconds=max_wait_seconds)

    async def pause(self, provider: str, *, seconds: float, plan: QuotaPlan) -> ProviderView:
        self._call("pause")
        return await super().pause(provider, seconds=seconds, plan=plan)

    async def take_probe(self, provider: str, *, owner: str, policy: BreakerPolicy) -> ProbeTaken:
        self._call("take_probe")
        return await super().take_probe(provider, owner=owner, policy=policy)

    async def record_failure(
        self, provider: str, *, code: str, probe_owner: str | None, policy: BreakerPolicy
    ) -> ProviderView:
        self._call("record_failure")
        return await super().record_failure(
            provider, code=code, probe_owner=probe_owner, policy=policy
        )

    async def record_success(self, provider: str) -> ProviderView:
        self._call("record_success")
        return await super().record_success(provider)


@dataclass
class World:
    """One shared store and clock; each ``guard()`` is another process's guard on it."""

    clock: ManualClock = field(default_factory=lambda: ManualClock(START))
    provider: str = field(default_factory=lambda: f"test:{uuid.uuid4().hex[:8]}")
    sleeps: list[float] = field(default_factory=list)
    store: CountingStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = CountingStore(self.clock)

    async def sleep(self, seconds: float) -> None:
        """Sleeping moves the shared clock: waits are recorded, never slept."""
        self.sleeps.append(round(seconds, 6))
        self.clock.advance(seconds)
        await asyncio.sleep(0)

    def monotonic(self) -> float:
        return self.clock.now().timestamp()

    def guard(
        self,
        *,
        plan: QuotaPlan | None = None,
        policy: BreakerPolicy | None = None,
        refresh_seconds: float = 0.0,
        **timing: float,
    ) -> ProviderGuard:
        return ProviderGuard(
            self.provider,
            self.store,
            rules=GuardRules(
                plan=plan or QuotaPlan(),
                breaker=policy or BreakerPolicy(failure_threshold=2, open_seconds=30),
                timing=GuardTiming(refresh_seconds=refresh_seconds, **timing),
            ),
            owner="test",
            sleep=self.sleep,
            monotonic=self.monotonic,
        )


class ScriptedEmbedder(FixedIdentity):
    """Answers with zeros, or raises the next scripted error; ``gate`` holds a request
    inside the provider until set."""

    def __init__(self, *outcomes: Exception | None) -> None:
        super().__init__("m", 4, TokenizerSpec("approximate", None, 512))
        self.outcomes: deque[Exception | None] = deque(outcomes)
        self.calls = 0
        self.entered = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        outcome = self.outcomes.popleft() if self.outcomes else None
        if outcome is not None:
            raise outcome
        return np.zeros((len(texts), self.dimension), dtype=np.float32)

    async def aclose(self) -> None:
        pass
