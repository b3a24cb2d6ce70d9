"""The operator page in real headless Chromium against `kb serve`: sign-in (a tenant key is
refused), the overview's numbers equal the database's, a dead task's Requeue click moves it
to PENDING and the page shows the audit line.

Screenshots go to $KB_SCREENSHOT_DIR when set (the README's docs/operator-*.png are made
that way), else to the test's temporary folder.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from playwright.async_api import Page

from tests.e2e.test_publisher_serve import kb, kb_serve
from tests.support.api import free_port
from tests.support.browser import chromium_page, screenshot_folder
from tests.support.operator import tier_counts
from tests.support.tasks import create_task

pytestmark = pytest.mark.e2e


async def seed_last_hour(conn: asyncpg.Connection[Any]) -> uuid.UUID:
    """Finished tasks over the last hour (for the chart), a due one and a dead one."""
    for minute in range(0, 60, 3):
        task = await create_task(conn)
        await conn.execute(
            """UPDATE index_task SET status = 'SUCCEEDED', attempts = 1,
                      finished_at = now() - make_interval(mins => $2)
                WHERE task_id = $1""",
            task.task_id,
            minute,
        )
        await conn.execute(
            """INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                                    embedding_model, switched_at)
               VALUES ($1, $2, 1, 'all-MiniLM-L6-v2-onnx-int8',
                       now() - make_interval(mins => $3))""",
            task.tenant_id,
            task.document_id,
            minute,
        )
        await conn.execute(
            """UPDATE document_version SET published_at = now() - make_interval(mins => $2)
                                                          - make_interval(secs => $3)
                WHERE document_id = $1""",
            task.document_id,
            minute,
            0.2 + (minute % 7) / 10,
        )
    await create_task(conn)  # due
    dead = await create_task(conn)
    await conn.execute(
        """UPDATE index_task SET status = 'DEAD', attempts = 1,
                  error_code = 'DOCUMENT_PARSE_FAILED', error_message = 'PDF: EOF marker not found',
                  finished_at = now() WHERE task_id = $1""",
        dead.task_id,
    )
    return dead.task_id


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    return screenshot_folder(tmp_path)


async def metric(page: Page, tier: str, name: str) -> str:
    return (await page.inner_text(f'tr[data-tier="{tier}"] td[data-metric="{name}"]')).strip()


async def test_operator_page_in_chromium(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], shots: Path
) -> None:
    tenant = kb(service_env, "tenants", "create", "acme", "--tier", "standard")
    assert tenant.returncode == 0, tenant.stderr
    tenant_key = tenant.stdout.strip().removeprefix("KB_API_KEY=")
    operator = kb(service_env, "operators", "create", "alice")
    assert operator.returncode == 0, operator.stderr
    operator_key = operator.stdout.strip().removeprefix("KB_OPERATOR_KEY=")
    dead = await seed_last_hour(conn)
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    with kb_serve(service_env, port):
        async with chromium_page() as page:
            await page.goto(f"{base}/ui")
            assert page.url == f"{base}/ui/login"

            await page.fill("#token", tenant_key)
            await page.click("#sign-in")
            await page.wait_for_selector("#login-error")
            assert page.url.startswith(f"{base}/ui/login")

            await page.fill("#token", operator_key)
            await page.click("#sign-in")
            await page.wait_for_selector("#tiers")
            counts = await tier_counts(conn, "standard")
            assert await metric(page, "standard", "due") == str(counts["due"]) == "1"
            assert await metric(page, "standard", "running") == str(counts["running"])
            assert await metric(page, "standard", "dead") == str(counts["dead"]) == "1"
            assert await page.inner_text("#hour-succeeded") == "20"
            await page.screenshot(path=str(shots / "operator-overview.png"), full_page=True)

            await page.goto(f"{base}/ui/dead")
            await page.click(f'tr[data-task="{dead}"] button.requeue-one')
            await page.wait_for_selector("#requeue-result")
            audit = await page.inner_text("#audit")
            assert f"operator:alice requeued task {dead}" in audit
            status = await conn.fetchval("SELECT status FROM index_task WHERE task_id = $1", dead)
            assert status == "PENDING"

            document_id = await conn.fetchval(
                "SELECT document_id FROM index_task WHERE task_id = $1", dead
            )
            await page.goto(f"{base}/ui/tenants/acme/documents/{document_id}")
            await page.wait_for_selector("#tasks")
            await page.screenshot(path=str(shots / "operator-document.png"), full_page=True)
