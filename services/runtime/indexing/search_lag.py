"""The search-version lag (docs/architecture.md#observability): documents whose search version lags
the published one, and the oldest lag's age. Exported by every long-running process that has a pool
(publisher, relay), so the lag is visible even while no indexer runs."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import Gauge

from services.runtime.logging import get_logger
from services.runtime.pg.sql import queries_beside

log = get_logger(__name__)
QUERIES = queries_beside(__file__, "search_lag.sql")

LAGGING_DOCUMENTS = Gauge(
    "kb_search_version_lagging_documents",
    "Published documents whose search version is older than the published version",
)
OLDEST_LAG = Gauge(
    "kb_search_version_oldest_lag_seconds",
    "How long the longest-lagging document has been published without being searchable "
    "(0 when none lags)",
)


@dataclass(frozen=True)
class SearchLag:
    lagging: int
    oldest_lag_seconds: float


async def sample_search_lag(pool: Any, now: datetime | None = None) -> SearchLag:
    row = await pool.fetchrow(QUERIES["search_lag"], now)
    lag = SearchLag(int(row["lagging"]), max(0.0, float(row["oldest_lag_seconds"] or 0.0)))
    LAGGING_DOCUMENTS.set(lag.lagging)
    OLDEST_LAG.set(lag.oldest_lag_seconds)
    return lag


async def run_search_lag_sampler(
    pool: Any, stop: asyncio.Event, *, interval_seconds: float = 15.0
) -> None:
    while not stop.is_set():
        try:
            await sample_search_lag(pool)
        except Exception as error:  # a metric never takes its process down
            log.warning("metrics.search_lag_failed", error=f"{type(error).__name__}: {error}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_seconds)
