"""The operator page's deletes, erasures and retention in real headless Chromium against
`kb serve`: a document erased with `kb documents erase` and a version emptied by `kb index
retention` show on the overview, on /ui/lifecycle (reached from the menu) and on their
documents' pages.

Screenshots go to $KB_SCREENSHOT_DIR when set, else to the test's temporary folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.e2e.test_publisher_serve import kb, kb_serve
from tests.support.api import free_port
from tests.support.browser import chromium_page, screenshot_folder
from tests.support.tasks import create_task, supersede_40_days_ago

pytestmark = pytest.mark.e2e


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    return screenshot_folder(tmp_path)


async def test_lifecycle_in_chromium(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], shots: Path
) -> None:
    assert kb(service_env, "tenants", "create", "acme", "--tier", "standard").returncode == 0
    operator = kb(service_env, "operators", "create", "alice")
    assert operator.returncode == 0, operator.stderr
    operator_key = operator.stdout.strip().removeprefix("KB_OPERATOR_KEY=")

    erased = await create_task(conn)
    erase = kb(service_env, "documents", "erase", "acme", str(erased.document_id))
    assert erase.returncode == 0, erase.stderr
    # v1 superseded by a publish 40 days ago (the database's clock), its task finished.
    kept = await create_task(conn)
    await supersede_40_days_ago(conn, kept)
    retention = kb(service_env, "index", "retention")
    assert retention.returncode == 0, retention.stderr
    assert "1 versions' content removed" in retention.stderr
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    with kb_serve(service_env, port):
        async with chromium_page() as page:
            await page.goto(f"{base}/ui/login")
            await page.fill("#token", operator_key)
            await page.click("#sign-in")
            await page.wait_for_selector("#lifecycle")
            overview = {
                name: (await page.inner_text(f'#lifecycle dd[data-metric="{name}"]')).strip()
                for name in ("deleted", "erased", "erasing")
            }
            assert overview == {"deleted": "1", "erased": "1", "erasing": "0"}
            removed = await page.inner_text('#lifecycle dd[data-metric="removed_versions"]')
            assert removed.startswith("1 (")

            await page.click("nav >> text=Deletes")
            await page.wait_for_selector("#erasures")
            assert page.url == f"{base}/ui/lifecycle"
            erasure = await page.inner_text(f'#erasures tr[data-document="{erased.document_id}"]')
            assert "cli" in erasure
            assert "in progress" not in erasure
            assert await page.is_visible(f'#deletes tr[data-document="{erased.document_id}"]')
            emptied = await page.inner_text(f'#retention tr[data-document="{kept.document_id}"]')
            assert "v1" in emptied
            await page.screenshot(path=str(shots / "operator-lifecycle.png"), full_page=True)

            await page.click(f'#erasures tr[data-document="{erased.document_id}"] a')
            await page.wait_for_selector("#lifecycle-state")
            assert (await page.inner_text("#lifecycle-state")).startswith("ERASED at ")
            await page.goto(f"{base}/ui/tenants/acme/documents/{kept.document_id}")
            content = await page.inner_text('tr[data-version="1"] td.retention')
            assert content.startswith("removed by retention at ")
            assert await page.inner_text('tr[data-version="2"] td.retention') == "kept"
