"""Debian's chromium, headless, driven by playwright: the status page as an operator's
browser sees it.  Each session has a new, empty profile and nothing that would reach out to
the network (the machines that run the tests have none)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

from tests.system_packages import PACKAGES, require

CHROMIUM = PACKAGES["chromium"][0]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def chromium(viewport: tuple[int, int] = (1440, 900)) -> Iterator:
    """A playwright BrowserContext on /usr/bin/chromium (never a downloaded browser)."""
    require("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - the test extra installs it
        import pytest

        pytest.fail("playwright is not installed: pip install -e '.[test]' (make setup)")
    with tempfile.TemporaryDirectory(prefix="mms-chromium-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": viewport[0], "height": viewport[1]}, color_scheme="light",
            timezone_id="UTC", locale="en-US")
        try:
            yield context
        finally:
            context.close()
