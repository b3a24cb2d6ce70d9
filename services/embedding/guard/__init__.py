"""The embedding provider's shared guard (issue 27): one limiter (GCRA with reservations)
and one circuit breaker per provider key, shared by every process through PostgreSQL.

- ``quota``: the limiter's arithmetic; ``breaker``: the breaker's state machine (pure);
- ``ports``: the store of the shared state; ``store_pg`` and ``store_memory`` implement it;
- ``guard``: ``ProviderGuard`` (claim gate, before/after each request, tenant shares);
- ``guarded``: ``GuardedEmbedder``; ``identity``: ``provider_key``; ``factory``: ``build_guard``.
"""
