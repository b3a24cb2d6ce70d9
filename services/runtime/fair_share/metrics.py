"""Fair-share metrics (docs/metrics.md#fair-shares). Labels: kind, tier and reason -- never
a tenant (its id is in the ``fair_share.limited`` log line)."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

# The label of a tenant whose tier could not be read.
UNKNOWN_TIER: Final = "unknown"

REFUSALS = Counter(
    "kb_fair_share_refusals",
    "Requests answered 429 because their tenant was beyond its share of this process, by "
    "kind (search, publish), the tenant's tier and reason (concurrency, rate; slot_wait: a "
    "search found no search slot within KB_FAIR_SEARCH_SLOT_WAIT_SECONDS)",
    ["kind", "tier", "reason"],
)
SLOT_WAIT = Histogram(
    "kb_fair_search_slot_wait_seconds",
    "How long an admitted search waited for one of the process's search slots (a search "
    "that stepped aside between its phases waits once more)",
    ["tier"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STEPPED_ASIDE = Counter(
    "kb_fair_search_stepped_aside",
    "Searches that handed their slot to a quieter tenant between two of their phases, and "
    "waited for one again",
    ["tier"],
)
