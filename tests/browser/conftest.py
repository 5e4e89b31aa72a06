"""A real headless Chromium (Debian's ``chromium`` package) driven by Playwright.

Playwright never downloads a browser here: it launches ``/usr/bin/chromium``
(``OUTBOX_CHROMIUM`` overrides the path). ``.ci/run`` installs the package.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("OUTBOX_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The docs (docs/console.md) show the screenshots the tests take.
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "console"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    # Module scope: Playwright's sync API holds an event loop on this thread while it
    # runs, and every later test that calls asyncio.run() needs it gone.
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (see .ci/run)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    tab = context.new_page()
    tab.set_default_timeout(15_000)
    yield tab
    context.close()


def screenshot(page: Any, name: str) -> Path:
    """Save the page as ``docs/console/<name>.png`` and return the path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
