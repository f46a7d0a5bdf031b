"""Decode work bounded by what a request may produce (issue 30): formats outside the allow-list and inputs far larger
than the model's largest output are refused from their header, and the copies of one edit decode its files once.

Broken on purpose once each: without the pixel limit the 16 parallel 8192 x 8192 edits were decoded in full (each
~200 MB of pixels) and the other clients' median latency grew many times; without the shared decode an n=4 edit
decoded its image 4 times; with admitted images not kept, the step thread decoded the edit's image and mask again."""

from __future__ import annotations

import asyncio
import io
import statistics
import time

import aiohttp
import pytest
from pictures import picture
from PIL import Image

from diffusiond.models.inputs import ADMITTED, DECODED_INPUTS, input_pixel_limit

TIMEOUT = aiohttp.ClientTimeout(total=120)
SMALL = {"prompt": "a red circle", "seed": 1, "width": 64, "height": 64, "num_inference_steps": 2}


def blank_png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def edit_form(image: bytes, mask: bytes | None = None, n: int = 1) -> aiohttp.FormData:
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("image", image, filename="image.png", content_type="image/png")
    if mask is not None:
        form.add_field("mask", mask, filename="mask.png", content_type="image/png")
    form.add_field("prompt", "a red circle")
    form.add_field("size", "64x64")
    form.add_field("n", str(n))
    form.add_field("num_inference_steps", "2")
    return form


def test_the_input_limit_follows_the_model():
    assert input_pixel_limit(64 * 64) == 4 << 20  # small models: 2048 x 2048
    assert input_pixel_limit(4 << 20) == 16 << 20  # 4x the largest output
    assert input_pixel_limit(None) == input_pixel_limit(1 << 40) == 64 << 20


@pytest.mark.asyncio
async def test_a_format_outside_the_allow_list_is_refused(server):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buf, format="TIFF")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{server.base_url}/v1/images/edits", data=edit_form(buf.getvalue())) as resp,
    ):
        error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "image" and "PNG" in error["message"], error


@pytest.mark.asyncio
async def test_huge_inputs_cost_no_decode_and_slow_no_one(server):
    """16 parallel edits with an 8192 x 8192 image and mask, n=10, while other clients generate: each edit is
    refused from its header (400 naming the image), and the others' median latency stays within 2x of idle."""
    huge = blank_png(8192)
    assert len(huge) < 1 << 20

    async def generate(session) -> float:
        t0 = time.monotonic()
        async with session.post(f"{server.base_url}/v1/generations", json=SMALL) as resp:
            await resp.read()
            assert resp.status == 200
        return time.monotonic() - t0

    async def huge_edit(session) -> tuple[int, dict]:
        async with session.post(f"{server.base_url}/v1/images/edits", data=edit_form(huge, huge, n=10)) as resp:
            return resp.status, await resp.json()

    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await generate(session)
        idle = statistics.median(await asyncio.gather(*(generate(session) for _ in range(8))))
        decodes = DECODED_INPUTS.decodes
        edits = [asyncio.create_task(huge_edit(session)) for _ in range(16)]
        busy = statistics.median(await asyncio.gather(*(generate(session) for _ in range(8))))
        answers = await asyncio.gather(*edits)
    for status, body in answers:
        assert status == 400 and body["error"]["param"] == "image" and "8192x8192" in body["error"]["message"], body
    assert DECODED_INPUTS.decodes == decodes
    assert busy < 2 * idle + 0.05, (idle, busy)
    print(f"median latency idle {idle * 1000:.0f} ms, beside 16 huge edits {busy * 1000:.0f} ms")


@pytest.mark.asyncio
async def test_an_edit_is_decoded_once_at_admission_never_on_the_step_thread(server):
    """The image and the mask of an n=4 edit are decoded once each, in the encoder pool when the request arrives;
    the step thread takes the decoded images for all four copies and decodes nothing (before: it decoded each file
    once more while every request of the batch waited)."""
    image = picture(80, 64, seed=1)
    mask = picture(80, 64, seed=2, mode="L")
    server.wait_idle()
    decodes, hits = DECODED_INPUTS.decodes, ADMITTED.hits
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{server.base_url}/v1/images/edits", data=edit_form(image, mask, n=4)) as resp,
    ):
        body = await resp.json()
    assert resp.status == 200 and len(body["data"]) == 4, body
    assert DECODED_INPUTS.decodes == decodes  # nothing decoded on the step thread
    assert ADMITTED.hits - hits == 2  # the image once, the mask once, for the four copies
    assert not DECODED_INPUTS.entries  # nothing the step thread took outlives its step


def test_a_file_the_budget_let_go_is_decoded_on_the_step_thread_once():
    """Past ADMITTED's budget the oldest admitted images go; the step thread then decodes such a file itself (as the
    other ranks of a group always do), once for the copies of one request, and gets the same image."""
    from diffusiond.models.inputs import Admitted, admit_image, open_rgb

    data = picture(80, 64, seed=3)
    admit_image(data, "image")
    admitted = open_rgb(data)
    DECODED_INPUTS.clear()
    small = Admitted(budget=10)
    small.put("rgb", data, admitted)  # over its budget at once: gone
    assert small.get("rgb", data) is None
    decodes = DECODED_INPUTS.decodes
    import diffusiond.models.inputs as inputs

    saved, inputs.ADMITTED = inputs.ADMITTED, small
    try:
        copies = [open_rgb(data) for _ in range(3)]
    finally:
        inputs.ADMITTED = saved
        DECODED_INPUTS.clear()
    assert DECODED_INPUTS.decodes - decodes == 1
    assert all(c is copies[0] for c in copies) and copies[0].tobytes() == admitted.tobytes()
