"""The playground page in headless Chromium (Debian's package, driven by Playwright): type a prompt, watch
previews arrive, then the final image."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
from needs import missing

from diffusiond.models.default import default_model

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
        missing("needs chromium (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield browser
        browser.close()


@contextlib.contextmanager
def opened(browser, **options):
    """A new page of `browser` (closed after) and the errors its scripts raise, collected."""
    page = browser.new_page(**options)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page, errors
    finally:
        page.close()


def test_previews_then_final_image(server, browser):
    with opened(browser) as (page, errors):
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
        # The refinement plays back once after the end, then the final image stays.
        page.wait_for_function("document.getElementById('status').dataset.replaying === '0'", timeout=30_000)
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


@pytest.fixture(scope="module")
def demo(serve):
    return serve(model=default_model(), max_steps=None)


def test_the_form_follows_the_model_and_reports_unknown_words(demo, browser):
    """The bundled model's declared capabilities shape the form; its full-size decoded previews refine visibly;
    unknown words are shown; on a narrow screen the form stacks above the image. PLAYGROUND_SCREENSHOTS=DIR saves
    screenshots mid-request and done (docs/playground has the README's)."""
    shots = os.environ.get("PLAYGROUND_SCREENSHOTS")
    with opened(browser, viewport={"width": 1100, "height": 760}) as (page, errors):
        page.goto(demo.base_url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('diffusiond-shapes')")
        assert page.is_disabled("#width") and page.is_disabled("#height") and page.is_disabled("#negative")
        assert page.get_attribute("#steps", "min") == "4"
        assert "circle" in page.text_content("#draws")
        page.fill("#prompt", "a large red circle in the center on a white background")
        page.fill("#steps", "60")
        page.fill("#seed", "3")
        page.select_option("#mode", "vae")
        page.click("#go")
        page.wait_for_function("Number(document.getElementById('status').dataset.previews) >= 12", timeout=30_000)
        if shots:
            page.screenshot(path=str(Path(shots) / "playground-running.png"))
        page.wait_for_function("document.getElementById('status').dataset.state === 'completed'", timeout=60_000)
        assert page.text_content("#warning") == ""
        size = page.evaluate("() => [...document.querySelectorAll('#strip img')].map((i) => i.naturalWidth)")
        assert size and set(size) == {64}, size  # decoded previews: full size
        page.wait_for_function("document.getElementById('status').dataset.replaying === '0'", timeout=30_000)
        if shots:
            page.screenshot(path=str(Path(shots) / "playground-done.png"))
        # Words it does not know are shown (the request still runs).
        page.fill("#prompt", "a small red cat in the center on a white background")
        page.fill("#steps", "8")
        page.click("#go")
        page.wait_for_function("document.getElementById('status').dataset.state === 'completed'", timeout=60_000)
        assert "cat" in page.text_content("#warning")
        # A request the model does not serve: an error, shown as one.
        page.fill("#steps", "2")
        page.evaluate("() => { document.getElementById('steps').min = '1'; }")  # past the form's own guard
        page.click("#go")
        page.wait_for_function("document.getElementById('status').dataset.state === 'failed'", timeout=30_000)
        assert "num_inference_steps" in page.text_content("#status")
        assert "error" in page.get_attribute("#status", "class")
        # Narrow screens: the form above the image, not beside it.
        page.set_viewport_size({"width": 420, "height": 900})
        form, view = page.locator("#form").bounding_box(), page.locator("section.view").bounding_box()
        assert view["y"] >= form["y"] + form["height"] - 1, (form, view)
        if shots:
            page.screenshot(path=str(Path(shots) / "playground-narrow.png"), full_page=True)
        assert not errors, errors


def test_a_sound_model_plays_its_track(serve, tiny_stable_audio, browser):
    """Stable Audio Open's family: the form asks no size, previews are pictures of the sound, and the answer is a
    track the page plays (WAV)."""
    server = serve(model=tiny_stable_audio)
    with opened(browser) as (page, errors):
        page.goto(server.base_url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('stable-audio')")
        assert not page.is_visible("#width") and "Makes sound (64 Hz)" in page.text_content("#draws")
        page.fill("#steps", "4")
        page.fill("#every", "1")
        page.fill("#seed", "5")
        page.select_option("#mode", "vae")
        page.click("#go")
        page.wait_for_function("document.getElementById('status').dataset.state === 'completed'", timeout=60_000)
        assert int(page.get_attribute("#status", "data-previews")) == 3  # steps 1-3: none after the last
        assert page.is_visible("#sound")
        assert page.get_attribute("#sound", "src").startswith("data:audio/wav;base64,")
        assert "Done (seed 5)" in page.text_content("#status")
        assert not errors, errors
