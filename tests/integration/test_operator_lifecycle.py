"""The operator page's view of a document's end (services/operator, real database): the
overview counts deletes, erasures and what retention removed; /ui/lifecycle lists the
erasure audit (when, which key or the CLI, tenant; no content), the deletes and the
versions retention emptied; a document's page says DELETED or ERASED and which versions'
content retention removed."""

from __future__ import annotations

import re
import uuid
from typing import Any

import asyncpg
import pytest

from tests.integration.test_version_retention import DAYS, corpus, db_time, retention
from tests.support.operator import operator_client, operator_settings, sign_in
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration


def metric(html: str, name: str) -> str:
    found = re.search(rf'data-metric="{name}"[^>]*>([^<]*)<', html)
    assert found is not None, f"no {name} on the page"
    return found.group(1).strip()


def row(html: str, table: str, document_id: uuid.UUID) -> str:
    body = re.search(rf'<table id="{table}">(.*?)</table>', html, re.S)
    assert body is not None, f"no table {table}"
    found = re.search(rf'<tr data-document="{document_id}">(.*?)</tr>', body.group(1), re.S)
    assert found is not None, f"{document_id} not in {table}"
    return re.sub(r"<[^>]+>", " ", found.group(1))


async def test_deletes_erasures_and_retention_on_the_operator_pages(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    docs = await corpus(pool)
    await retention(pool).collect(now=await db_time(pool, DAYS + 1))
    # The deleted document erased from the CLI; another deleted, its erase (by an admin key)
    # still in progress.
    await pool.execute(
        """INSERT INTO document_erasure (tenant_id, document_id, requested_by, requested_at,
                                         erased_at)
           VALUES ($1, $2, 'cli', now(), now())""",
        docs.deleted.tenant_id,
        docs.deleted.document_id,
    )
    erasing = await create_task(pool)
    key_id = uuid.uuid4()
    await pool.execute(
        """WITH d AS (UPDATE document SET deleted_at = now() WHERE document_id = $2)
           INSERT INTO document_erasure (tenant_id, document_id, key_id, requested_by,
                                         requested_at)
           VALUES ($1, $2, $3, 'api', now())""",
        erasing.tenant_id,
        erasing.document_id,
        key_id,
    )
    removed_bytes = await pool.fetchval(
        "SELECT sum(size_bytes) FROM document_version WHERE content_removed_at IS NOT NULL"
    )

    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        overview = (await client.get("/ui")).text
        assert (metric(overview, "deleted"), metric(overview, "erased")) == ("2", "1")
        assert metric(overview, "erasing") == "1"
        assert metric(overview, "removed_versions").startswith("2 (")

        page = await client.get("/ui/lifecycle")
        assert page.status_code == 200
        html = page.text
        assert metric(html, "removed_versions") == "2"
        assert metric(html, "removed_bytes").startswith(f"{removed_bytes} B")
        assert metric(html, "retention_due") == "0"
        assert "kept 30 days" in html
        erased = row(html, "erasures", docs.deleted.document_id)
        assert "cli" in erased
        assert "in progress" not in erased
        in_progress = row(html, "erasures", erasing.document_id)
        assert str(key_id) in in_progress
        assert "in progress" in in_progress
        assert docs.deleted.tenant_id in row(html, "deletes", docs.deleted.document_id)
        assert "v1" in row(html, "retention", docs.served.document_id)
        # No content: the titles of the documents are not on the page.
        assert "test document" not in html

        served = (await client.get(f"/ui/tenants/acme/documents/{docs.served.document_id}")).text
        assert "removed by retention at" in _version(served, 1)
        assert "kept (superseded at" in _version(served, 2)
        assert _version(served, 3).strip().endswith("kept")
        assert 'id="lifecycle-state"' not in served
        gone = (await client.get(f"/ui/tenants/acme/documents/{docs.deleted.document_id}")).text
        assert re.search(r'id="lifecycle-state">ERASED at ', gone)
        assert 'id="search-version">nothing: deleted<' in gone
        deleting = (await client.get(f"/ui/tenants/acme/documents/{erasing.document_id}")).text
        assert re.search(r'id="lifecycle-state">DELETED at [^<]*; erase in progress', deleting)
        listing = (await client.get("/ui/tenants/acme/documents")).text
        assert "DELETED" in listing


def _version(html: str, number: int) -> str:
    found = re.search(rf'<tr data-version="{number}">(.*?)</tr>', html, re.S)
    assert found is not None, f"no v{number} row"
    content = re.search(r'<td class="retention">([^<]*)</td>', found.group(1))
    assert content is not None
    return content.group(1)
