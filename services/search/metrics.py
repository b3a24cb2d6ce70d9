"""Search metrics (docs/metrics.md#search). Labels: the reason only -- never a tenant.

The HTTP metrics of the search route (requests, latency) are the app's
(``services/publisher/metrics.py``); this module counts what only search knows.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

from services.runtime.indexing.index_failures import PROVIDER_FAILURE_CODES

# The reason a search degraded when the searcher's own timeout ran out (otherwise the
# provider's failure code).
TIMEOUT_REASON: Final = "timeout"

DEGRADED = Counter(
    "kb_search_degraded",
    "Hybrid searches answered from the keyword list alone because the query could not be "
    "embedded, by reason: the provider's failure code, or timeout",
    ["reason"],
)

# Every reason, so that each series exists (at 0) before the first degraded search.
DEGRADED_REASONS: Final = (*sorted(PROVIDER_FAILURE_CODES), TIMEOUT_REASON)
for _reason in DEGRADED_REASONS:
    DEGRADED.labels(reason=_reason)


# Search on read replicas (services/search/replicas.py). A replica's label is its
# host:port/database, never its user or password.
REPLICA_LAG = Gauge(
    "kb_search_replica_lag_seconds",
    "How long ago the primary first had WAL this search replica has not replayed (0: caught "
    "up at the last check; the time since its last answer while it does not answer)",
    ["replica"],
)
REPLICA_IN_ROTATION = Gauge(
    "kb_search_replica_in_rotation",
    "1 while searches read this replica, 0 while it lags too much or does not answer",
    ["replica"],
)
SEARCH_READS = Counter(
    "kb_search_reads",
    "Searches by the server they read: primary, or a replica's host:port/database",
    ["server"],
)
TOKEN_WAIT = Histogram(
    "kb_search_after_wait_seconds",
    "How long searches with `after` tokens waited for a replica to replay them (those the "
    "primary answered after the wait included)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def count_degraded(reason: str) -> None:
    DEGRADED.labels(reason=reason).inc()
