"""Headless Chromium for the operator page's tests (Debian's `chromium`, installed by
`scripts/bootstrap --browser`): one page, closed with its browser at the end."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from playwright.async_api import Page, async_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@asynccontextmanager
async def chromium_page() -> AsyncIterator[Page]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            yield await (
                await browser.new_context(viewport={"width": 1280, "height": 900})
            ).new_page()
        finally:
            await browser.close()


def screenshot_folder(default: Path) -> Path:
    """$KB_SCREENSHOT_DIR when set (the README's docs/operator-*.png are made that way),
    else ``default``."""
    folder = Path(os.environ.get("KB_SCREENSHOT_DIR") or default)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
