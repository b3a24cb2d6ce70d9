"""The guard the settings ask for, on the store given (a pool: the shared PostgreSQL
state; a store; or nothing: this process's memory, shared with no other)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.embedding.guard.breaker import BreakerPolicy
from services.embedding.guard.guard import GuardRules, GuardTiming, ProviderGuard
from services.embedding.guard.guarded import GuardedEmbedder
from services.embedding.guard.identity import provider_key
from services.embedding.guard.ports import ProviderStateStore
from services.embedding.guard.quota import Purpose, QuotaPlan
from services.embedding.guard.store_memory import InMemoryProviderStateStore
from services.embedding.port import Embedder
from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.embedding.tokens import load_token_counter
from services.runtime.pg.clock import Clock
from services.runtime.settings import section_of

if TYPE_CHECKING:
    import asyncpg


def quota_plan(settings: EmbeddingSettings) -> QuotaPlan:
    per_minute = settings.rate_tokens_per_minute
    tokens_per_second = None if per_minute is None else per_minute / 60.0
    return section_of(QuotaPlan, settings, "rate_", tokens_per_second=tokens_per_second)


def breaker_policy(settings: EmbeddingSettings) -> BreakerPolicy:
    return section_of(BreakerPolicy, settings, "breaker_")


def guard_timing(settings: EmbeddingSettings) -> GuardTiming:
    # The one knob not named rate_: how stale a copy of the shared state may be.
    return section_of(
        GuardTiming, settings, "rate_", refresh_seconds=settings.guard_refresh_seconds
    )


def build_guard(
    settings: EmbeddingSettings,
    pool_or_store: asyncpg.Pool[Any] | ProviderStateStore | None,
    owner: str,
    *,
    clock: Clock | None = None,
) -> ProviderGuard:
    """``owner`` names this process in logs. ``clock``: the store's time (tests)."""
    store: ProviderStateStore
    if pool_or_store is None:
        store = InMemoryProviderStateStore(clock)
    elif _is_pool(pool_or_store):
        from services.embedding.guard.store_pg import PgProviderStateStore

        store = PgProviderStateStore(pool_or_store, clock=clock)  # type: ignore[arg-type]
    else:
        store = pool_or_store  # type: ignore[assignment]
    return ProviderGuard(
        provider_key(settings.provider),
        store,
        rules=GuardRules(quota_plan(settings), breaker_policy(settings), guard_timing(settings)),
        owner=owner,
    )


def _is_pool(candidate: object) -> bool:
    import asyncpg

    return isinstance(candidate, asyncpg.Pool)


def guarded(
    settings: EmbeddingSettings,
    inner: Embedder,
    pool: asyncpg.Pool[Any],
    *,
    purpose: Purpose,
    owner: str,
) -> tuple[Embedder, ProviderGuard | None]:
    """``inner`` behind the provider's shared guard (state in ``pool``'s database) when the
    provider is a remote one; a local model (``onnx-local``, ``hashing``) has no quota to
    share and no outage to ride out, so it is returned as it is, without a guard."""
    if not isinstance(settings.provider, OpenAIConfig):
        return inner, None
    guard = build_guard(settings, pool, owner)
    count = load_token_counter(inner.tokenizer)
    return GuardedEmbedder(inner, guard, purpose=purpose, owner=owner, count_tokens=count), guard
