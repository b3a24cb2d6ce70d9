"""The guard's metrics (docs/metrics.md). Labels: provider key, purpose, result only --
never a tenant. The process-wide registry: the indexer's and the API's /metrics serve it."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

from services.embedding.guard.breaker import BreakerState
from services.embedding.port import InputRefused
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed

REQUESTS = Counter(
    "kb_embedding_requests",
    "Embedding requests by result: ok, rate_limited, unavailable, timeout, malformed, invalid,"
    " refused (an input the provider refused), short_circuited (not sent: breaker or limiter)",
    ["provider", "purpose", "result"],
)
LIMITER_WAIT = Histogram(
    "kb_embedding_limiter_wait_seconds",
    "Time an embedding request waited for the shared limiter (0 when it went at once)",
    ["purpose"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BREAKER_STATE = Gauge(
    "kb_embedding_breaker_state",
    "The shared embedding circuit breaker: 0 closed, 1 half open (probing), 2 open",
    ["provider"],
)

RETRY_AFTER_CAPPED = Counter(
    "kb_embedding_retry_after_capped",
    "429 answers whose Retry-After was beyond KB_EMBEDDING_RATE_MAX_PAUSE_SECONDS: the shared"
    " breaker opened instead of a pause that long",
    ["provider"],
)

BREAKER_GAUGE: Final[dict[BreakerState, int]] = {
    BreakerState.CLOSED: 0,
    BreakerState.HALF_OPEN: 1,
    BreakerState.OPEN: 2,
}
_RESULTS: Final[dict[str, str]] = {
    ErrorCode.EMBEDDING_RATE_LIMITED: "rate_limited",
    ErrorCode.EMBEDDING_UNAVAILABLE: "unavailable",
    ErrorCode.EMBEDDING_TIMEOUT: "timeout",
    ErrorCode.EMBEDDING_RESPONSE_MALFORMED: "malformed",
}
SHORT_CIRCUITED: Final = "short_circuited"


def result_of(error: IndexingFailed | None) -> str:
    """The ``result`` label of a request that was sent."""
    if error is None:
        return "ok"
    if isinstance(error, InputRefused):
        return "refused"
    return _RESULTS.get(error.code, "invalid")
