"""Edits over HTTP: the official `openai` client's `images.edit` (plain and streamed), the native API's image
field, and every way a client can send a bad image: each a 400 naming the field, the server serving on."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import diffusers
import numpy as np
import openai
import pytest
import torch
from pictures import decoded, mask, picture
from PIL import Image

from diffusiond.daemon.image_encoding import to_uint8

PROMPT = "a red circle on a white background"
IMAGE = picture(80, 64, seed=1)
OTHER = picture(64, 64, seed=2)
TIMEOUT = aiohttp.ClientTimeout(total=60)


def png(b64: str | None) -> np.ndarray:
    assert b64
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def edit_kwargs(model_id: str, image: bytes = IMAGE, **extra) -> dict:
    return dict(
        model=model_id,
        image=("in.png", image, "image/png"),
        prompt=PROMPT,
        size="64x64",
        extra_body={"num_inference_steps": 8, "seed": 3, "strength": 0.75, **extra},
    )


def img2img_reference(checkpoint: str, image: bytes, **kw) -> np.ndarray:
    pipe = diffusers.StableDiffusion3Img2ImgPipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt=PROMPT,
        image=decoded(image),
        width=64,
        height=64,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
        **kw,
    )
    return to_uint8(out.images[0])


def test_openai_client_edits_the_image(server, model_id, tiny_sd3):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        result = client.images.edit(**edit_kwargs(model_id))
        other = client.images.edit(**edit_kwargs(model_id, image=OTHER))
    assert result.size == "64x64"
    image = png(result.data[0].b64_json)
    # Pixel for pixel diffusers' Img2Img pipeline on the same file (1 level: float vs uint8 rounding at .5).
    expected = img2img_reference(tiny_sd3, IMAGE, num_inference_steps=8, strength=0.75, guidance_scale=7.0)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    assert (
        np.abs(image.astype(int) - png(other.data[0].b64_json).astype(int)).mean() > 2
    )  # the image matters (rounding: < 0.5)


@pytest.mark.asyncio
async def test_openai_client_streams_edit_partial_images(server, model_id):
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        kwargs = edit_kwargs(model_id, num_inference_steps=32, strength=0.8)
        stream = await client.images.edit(**kwargs, stream=True, partial_images=2)
        async with stream:
            events = [event async for event in stream]
    types = [e.type for e in events]
    assert types == ["image_edit.partial_image", "image_edit.partial_image", "image_edit.completed"], types
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = png(events[2].b64_json)
    assert final.shape == (64, 64, 3)
    for partial in events[:2]:
        assert png(partial.b64_json).shape == final.shape
        assert not np.array_equal(png(partial.b64_json), final)


def test_openai_client_edit_errors(server, model_id):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        for kwargs, param in [
            (edit_kwargs(model_id, image=b"GIF89a not really"), "image"),
            (edit_kwargs(model_id, image=IMAGE[:300]), "image"),  # truncated
            (edit_kwargs(model_id, image=picture(32, 32, mode="I;16")), "image"),  # 16-bit pixels
            (edit_kwargs(model_id, strength=0), "strength"),
            (edit_kwargs(model_id, strength=1.5), "strength"),
            ({**edit_kwargs(model_id), "mask": ("mask.png", b"not an image", "image/png")}, "mask"),
            ({**edit_kwargs(model_id), "image": [("a.png", IMAGE), ("b.png", OTHER)]}, "image"),
            ({**edit_kwargs(model_id), "n": 11}, "n"),
            ({**edit_kwargs(model_id), "input_fidelity": "max"}, "input_fidelity"),
        ]:
            with pytest.raises(openai.BadRequestError) as bad:
                client.images.edit(**kwargs)
            assert bad.value.status_code == 400 and bad.value.param == param, (param, bad.value)
        check = client.images.edit(**edit_kwargs(model_id))  # still serving
    assert check.data[0].b64_json


async def _post_form(url: str, fields: list[tuple[str, bytes | str]]) -> tuple[int, dict]:
    form = aiohttp.FormData(default_to_multipart=True)  # also without a file, as OpenAI's clients send it
    for name, value in fields:
        if isinstance(value, bytes):
            form.add_field(name, value, filename=f"{name}.png", content_type="image/png")
        else:
            form.add_field(name, value)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.post(url, data=form) as resp:
        return resp.status, await resp.json()


@pytest.mark.asyncio
async def test_malformed_edit_bodies_are_400s(serve):
    server = serve(max_image_bytes=4096)
    url = f"{server.base_url}/v1/images/edits"
    big = picture(512, 512, seed=5)
    assert len(big) > 4096
    cases = [
        ([("prompt", "a dog")], "image"),  # no image
        ([("image", IMAGE)], "prompt"),
        ([("image", big), ("prompt", "a dog")], "image"),  # over --max-image-bytes
        ([("image", IMAGE), ("prompt", "a dog"), ("prompt", "a cat")], "prompt"),
        ([("image", IMAGE), ("prompt", "a dog"), ("size", "64")], "size"),
        ([("image", IMAGE), ("prompt", "a dog"), ("stream", "maybe")], "stream"),
        ([("image", IMAGE), ("prompt", "a dog"), ("colour", "red")], "colour"),
        ([("image", IMAGE), ("prompt", "x" * 70_000)], "prompt"),
    ]
    for fields, param in cases:
        status, body = await _post_form(url, fields)
        assert status == 400 and body["error"]["param"] == param, (param, body)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(url, json={"prompt": "a dog", "image": "aGk="}) as resp:
            assert resp.status == 400 and "multipart" in (await resp.json())["error"]["message"]
        async with session.post(
            url, data=b"--x\r\nnot a part", headers={"Content-Type": "multipart/form-data; boundary=x"}
        ) as resp:
            assert resp.status == 400, await resp.text()
    status, body = await _post_form(url, [("image", IMAGE), ("prompt", "a dog"), ("size", "64x64")])
    assert status == 200 and body["data"][0]["b64_json"]


@pytest.mark.asyncio
async def test_native_api_takes_an_image(server):
    body = {
        "prompt": PROMPT,
        "image": base64.b64encode(IMAGE).decode(),
        "strength": 0.5,
        "width": 64,
        "height": 64,
        "num_inference_steps": 8,
        "seed": 3,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 200, await resp.text()
            text = await resp.text()
        progress = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        steps = [e for e in progress if e["type"] == "progress"]
        assert steps and steps[-1]["total"] == 4  # the last half of 8 steps
        assert progress[-1]["type"] == "completed"
        for bad, param in [({"image": "%%%"}, "image"), ({"image": None, "strength": 0.5}, "strength")]:
            async with session.post(f"{server.base_url}/v1/generations", json={**body, **bad}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == param
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_openai_client_edits_by_instruction(serve, tiny_kontext):
    """An instruction-edit family (FLUX.1 Kontext): `images.edit` without strength, plain and streamed, is
    FluxKontextPipeline's image, called as its users call it (the context at the pipeline's own ~1 Mpx size; before,
    below 1 Mpx the daemon conditioned a smaller context and differed by 26-42/255 on real checkpoints); the cheaper
    `edit_context: "output"` is opt-in and changes the image; strength is refused naming the field."""
    server = serve(model=tiny_kontext)
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        model = (await client.models.list()).data[0].id
        kwargs = dict(
            model=model,
            image=("in.png", IMAGE, "image/png"),
            prompt="make it red",
            size="64x64",
            extra_body={"num_inference_steps": 6, "seed": 3},
        )
        result = await client.images.edit(**kwargs)
        cheaper = await client.images.edit(
            **{**kwargs, "extra_body": {**kwargs["extra_body"], "edit_context": "output"}}
        )
        stream = await client.images.edit(**kwargs, stream=True, partial_images=2)
        async with stream:
            events = [event async for event in stream]
        for extra, param in (({"extra_body": {"strength": 0.5}}, "strength"), ({"mask": ("m.png", IMAGE)}, "mask")):
            with pytest.raises(openai.BadRequestError) as bad:
                await client.images.edit(**{**kwargs, **extra})
            assert bad.value.param == param
    image = png(result.data[0].b64_json)
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert np.array_equal(png(events[-1].b64_json), image)  # the same seed streamed

    pipe = diffusers.FluxKontextPipeline.from_pretrained(tiny_kontext)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="make it red",
        image=decoded(IMAGE),
        width=64,
        height=64,
        max_area=64 * 64,
        num_inference_steps=6,
        guidance_scale=3.5,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    )
    assert np.abs(image.astype(int) - to_uint8(out.images[0]).astype(int)).max() <= 1
    assert np.abs(image.astype(int) - png(cheaper.data[0].b64_json).astype(int)).max() > 8


def test_openai_client_edits_with_two_images_on_qwen_image_edit_plus(serve, tiny_qwenimage_edit_plus):
    """Qwen-Image-Edit-Plus through the official SDK's `images.edit` with two images (`image=[...]`: the first is
    edited, the second is its reference): the image equals QwenImageEditPlusPipeline's for the same two images."""
    server = serve(model=tiny_qwenimage_edit_plus)
    first, second = picture(96, 64, seed=4), picture(64, 64, seed=5)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        result = client.images.edit(
            image=[("a.png", first, "image/png"), ("b.png", second, "image/png")],
            prompt="put the cat on the sofa",
            size="64x64",
            extra_body={"num_inference_steps": 3, "seed": 2, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
        )
    image = png(result.data[0].b64_json)
    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(tiny_qwenimage_edit_plus)
    pipe.set_progress_bar_config(disable=True)

    def pipeline(*files: bytes) -> np.ndarray:
        out = pipe(
            image=[decoded(f) for f in files],
            prompt="put the cat on the sofa",
            negative_prompt="blurry",
            true_cfg_scale=3.0,
            width=64,
            height=64,
            num_inference_steps=3,
            generator=torch.Generator().manual_seed(2),
            output_type="np",
        )
        return to_uint8(out.images[0]).astype(int)

    assert np.abs(image.astype(int) - pipeline(first, second)).max() <= 1
    only_first = pipeline(first)
    assert np.abs(image.astype(int) - only_first).max() > 4  # the second counted


@pytest.mark.asyncio
async def test_masks_reach_the_engine_in_either_convention(server, model_id):
    """An OpenAI edit with an RGBA mask (transparent: repainted) gives the native API's image for the same request
    with the "L" mask diffusers takes (white: repainted); without a mask, or with another, the image differs."""
    openai_mask, white = mask(80, 64, (0, 0, 40, 64), alpha=True)
    buf = io.BytesIO()
    white.save(buf, format="PNG")
    native = {
        "prompt": PROMPT,
        "image": base64.b64encode(IMAGE).decode(),
        "strength": 0.75,
        "width": 64,
        "height": 64,
        "num_inference_steps": 8,
        "seed": 3,
    }

    async def native_image(**fields) -> np.ndarray:
        url = f"{server.base_url}/v1/generations"
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(url, json={**native, **fields}) as resp,
        ):
            assert resp.status == 200, await resp.text()
            lines = (await resp.text()).splitlines()
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        return png(events[-1]["images"][0]["b64"])

    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        result = await client.images.edit(**edit_kwargs(model_id), mask=("mask.png", openai_mask, "image/png"))
    masked = png(result.data[0].b64_json)
    assert np.array_equal(masked, await native_image(mask=base64.b64encode(buf.getvalue()).decode()))
    other_mask, _ = mask(80, 64, (40, 0, 80, 64))
    for other in (await native_image(), await native_image(mask=base64.b64encode(other_mask).decode())):
        assert np.abs(masked.astype(int) - other.astype(int)).mean() > 2
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for bad in ({"mask": base64.b64encode(other_mask).decode(), "image": None, "strength": None}, {"mask": "aGk="}):
            async with session.post(f"{server.base_url}/v1/generations", json={**native, **bad}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "mask"


@pytest.mark.asyncio
async def test_openai_client_sends_reference_images(serve, tiny_flux2klein):
    """`images.edit(image=[...])` (multipart `image[]`) on a multi-reference family: the first file is the image to
    edit, the others its references, as Flux2KleinPipeline(image=[...]); the native API's `reference_images` gives
    the same image."""
    server = serve(model=tiny_flux2klein)
    files = [picture(80, 64, seed=1), picture(64, 64, seed=2)]
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        model = (await client.models.list()).data[0].id
        result = await client.images.edit(
            model=model,
            image=[(f"{i}.png", f, "image/png") for i, f in enumerate(files)],
            prompt="put them together",
            size="64x64",
            extra_body={"num_inference_steps": 4, "seed": 3},
        )
    image = png(result.data[0].b64_json)
    body = {
        "prompt": "put them together",
        "image": base64.b64encode(files[0]).decode(),
        "reference_images": [base64.b64encode(files[1]).decode()],
        "width": 64,
        "height": 64,
        "num_inference_steps": 4,
        "seed": 3,
    }
    url = f"{server.base_url}/v1/generations"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        lines = (await resp.text()).splitlines()
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert np.array_equal(png(events[-1]["images"][0]["b64"]), image)

    pipe = diffusers.Flux2KleinPipeline.from_pretrained(tiny_flux2klein)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="put them together",
        image=[decoded(f) for f in files],
        width=64,
        height=64,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    )
    assert np.abs(image.astype(int) - to_uint8(out.images[0]).astype(int)).max() <= 1
