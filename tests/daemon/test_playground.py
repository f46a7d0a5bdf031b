"""The playground page in headless Chromium (Debian's package, driven by Playwright): type a prompt, watch
previews arrive, then the final image."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
# As the machine's own probe starts it: no sandbox as root, and no background traffic to a network we do not have.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM) or shutil.which("chromium") is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run should install Debian's chromium package")
        pytest.skip("chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield browser
        browser.close()


def test_previews_then_final_image(server, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(server.base_url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('(')")
        page.fill("#prompt", "a small blue square in the middle on a yellow background")
        page.fill("#width", "64")
        page.fill("#height", "64")
        page.fill("#steps", "12")
        page.fill("#every", "2")
        page.fill("#seed", "7")
        page.click("#go")
        # At least one preview shows before the end...
        page.wait_for_function("Number(document.getElementById('status').dataset.previews) >= 1", timeout=30_000)
        page.wait_for_function("document.getElementById('status').dataset.state === 'completed'", timeout=60_000)
        previews = int(page.get_attribute("#status", "data-previews"))
        assert previews >= 1
        assert page.locator("#strip img").count() == previews
        # ...and the final image is a real decoded 64x64 PNG, not a preview.
        src = page.get_attribute("#image", "src")
        assert src.startswith("data:image/png;base64,")
        size = page.evaluate(
            "() => [document.getElementById('image').naturalWidth, document.getElementById('image').naturalHeight]"
        )
        assert size == [64, 64]
        assert "Done (seed 7)" in page.text_content("#status")
        # The load indicator reads /metrics.
        page.wait_for_function("document.getElementById('load').textContent.includes('mean batch')")
        assert not errors, errors
    finally:
        page.close()
