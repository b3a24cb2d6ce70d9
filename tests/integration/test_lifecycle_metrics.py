"""Deletes, erasures and retention on the metrics endpoints (docs/metrics.md), real
database: the API counts its deletes and erasures by outcome on its /metrics, and the
indexer's sampled gauges count them database-wide (an erase from `kb documents erase`
included); every lifecycle metric the code defines is documented."""

from __future__ import annotations

import re
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from services.indexer.gc import retention as retention_module
from services.indexer.gc.retention import RetentionCollector
from services.indexer.gc.settings import RetentionSettings
from services.runtime.settings import RuntimeSettings
from tests.support.api import add_tenant, publish, publisher_harness, upload
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.integration


async def test_deletes_and_erasures_are_counted(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any], pool: asyncpg.Pool[Any]
) -> None:
    tenant = await add_tenant(conn, "acme")
    async with publisher_harness(settings) as harness:
        client = harness.client
        deleted = (await upload(client, tenant, b"to delete")).json()
        published = await publish(client, tenant, deleted["documentId"], 1, deleted["revision"])
        revision = published.json()["revision"]
        for _ in range(2):  # the second answers what the first did
            gone = await client.delete(
                tenant.path(f"/documents/{deleted['documentId']}"),
                params={"revision": revision},
                headers=tenant.headers,
            )
            assert gone.status_code == 200, gone.text
        erased = (await upload(client, tenant, b"to erase")).json()
        for _ in range(2):
            answer = await client.post(
                tenant.path(f"/documents/{erased['documentId']}/erase"), headers=tenant.headers
            )
            assert answer.status_code == 200, answer.text
        text = (await client.get("/metrics")).text

    for operation in ("delete_document", "erase_document"):
        for result in ("ok", "unchanged"):
            line = f'kb_publisher_operations_total{{operation="{operation}",result="{result}"}}'
            assert f"{line} 1.0" in text

    totals = await RetentionCollector(pool, RetentionSettings()).sample_totals()
    assert (totals["deleted_documents"], totals["erased_documents"]) == (2.0, 1.0)
    assert totals["erasures_in_progress"] == 0.0
    assert REGISTRY.get_sample_value("kb_documents_erased") == 1.0
    # An erase stopped halfway is visible, with its age on the database's clock.
    await pool.execute(
        "UPDATE document_erasure SET erased_at = NULL, requested_at = now() - interval '2 hours'"
    )
    stalled = await RetentionCollector(pool, RetentionSettings()).sample_totals()
    assert stalled["erasures_in_progress"] == 1.0
    assert stalled["oldest_erasure_in_progress_seconds"] >= 7200


def test_every_lifecycle_metric_is_documented() -> None:
    documented = (REPO_ROOT / "docs" / "metrics.md").read_text()
    names = [f"{counter._name}_total" for counter in retention_module.REMOVED.values()]
    names += [gauge._name for gauge in retention_module.TOTALS.values()]
    assert len(names) == 9
    missing = [name for name in names if not re.search(rf"`{name}`", documented)]
    assert missing == []
