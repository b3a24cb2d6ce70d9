"""The gauges' queries against real rows: due, oldest due age, retry waiting, running,
expiring and expired leases per tier, and the search-version lag."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.indexer.metrics import OLDEST_DUE_AGE, TASKS_DUE, QueueGaugeSampler
from services.runtime.indexing.search_lag import LAGGING_DOCUMENTS, sample_search_lag
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


async def _set(pool: asyncpg.Pool[Any], task_id: object, **columns: object) -> None:
    assignments = ", ".join(f"{name} = ${i + 2}" for i, name in enumerate(columns))
    await pool.execute(
        f"UPDATE index_task SET {assignments} WHERE task_id = $1", task_id, *columns.values()
    )


async def test_queue_gauges_count_each_state_per_tier(pool: asyncpg.Pool[Any]) -> None:
    due_old = await create_task(pool, next_attempt_at=NOW - timedelta(seconds=90))
    await create_task(pool, next_attempt_at=NOW - timedelta(seconds=5))
    await create_task(pool, next_attempt_at=NOW + timedelta(seconds=60))  # PENDING, future
    backing_off = await create_task(pool)
    await _set(
        pool, backing_off.task_id, status="RETRY_WAIT", next_attempt_at=NOW + timedelta(minutes=5)
    )
    for until in (
        NOW + timedelta(seconds=25),
        NOW + timedelta(seconds=5),
        NOW - timedelta(seconds=1),
    ):
        running = await create_task(pool)
        await _set(
            pool, running.task_id, status="RUNNING", attempts=1, lease_owner="w", lease_until=until
        )
    await create_task(pool, tier="premium", next_attempt_at=NOW - timedelta(seconds=1))

    sampler = QueueGaugeSampler(pool, ["standard", "premium", "idle"], lease_seconds=30, now=NOW)
    rows = {row["tier"]: row for row in await sampler.sample()}

    assert rows["standard"]["due"] == 2
    assert rows["standard"]["oldest_due_age_seconds"] == pytest.approx(90.0)
    assert rows["standard"]["retry_waiting"] == 1
    assert rows["standard"]["running"] == 3
    assert rows["standard"]["expiring"] == 1  # within lease/3 = 10 s
    assert rows["standard"]["expired"] == 1
    assert rows["premium"]["due"] == 1
    assert rows["idle"]["due"] == 0
    assert rows["idle"]["oldest_due_age_seconds"] is None
    assert TASKS_DUE.labels("standard")._value.get() == 2
    assert OLDEST_DUE_AGE.labels("idle")._value.get() == 0
    assert due_old.tier == "standard"


async def test_search_lag_counts_published_documents_not_yet_served(
    pool: asyncpg.Pool[Any],
) -> None:
    served = await create_task(pool)
    await create_task(pool)  # published, never indexed
    await pool.execute(
        "UPDATE document SET published_at = $1 WHERE document_id <> $2",
        NOW - timedelta(minutes=10),
        served.document_id,
    )
    await pool.execute(
        """INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                                embedding_model)
           VALUES ($1, $2, 1, 'm')""",
        served.tenant_id,
        served.document_id,
    )
    lag = await sample_search_lag(pool, now=NOW)
    assert lag.lagging == 1
    assert lag.oldest_lag_seconds == pytest.approx(600.0)
    assert LAGGING_DOCUMENTS._value.get() == 1
