"""Search metrics (docs/metrics.md#search). Labels: the reason only -- never a tenant.

The HTTP metrics of the search route (requests, latency) are the app's
(``services/publisher/metrics.py``); this module counts what only search knows.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter

from services.runtime.index_failures import PROVIDER_FAILURE_CODES

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


def count_degraded(reason: str) -> None:
    DEGRADED.labels(reason=reason).inc()
