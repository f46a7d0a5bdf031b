"""The official `openai` client (sync and async) against a live daemon: plain, n=2 and streamed image generation."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

PROMPT = "a red circle on a white background"
SIZE = "64x64"
# Enough steps that the two partial images come from previews a few steps apart (a slow reader may coalesce
# previews that arrive back to back; see engine/mailbox.py).
STREAM_STEPS = 24


def decode_png(b64: str | None) -> np.ndarray:
    assert b64, "no b64_json in the response"
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), data[:16]
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def check_final(images: list[np.ndarray]) -> None:
    for image in images:
        assert image.shape == (64, 64, 3), image.shape
        # A real image, not a flat fill.
        assert image.std() > 1.0


def check_stream(events: list) -> None:
    types = [e.type for e in events]
    assert types == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ], types
    partials, final = events[:2], events[2]
    assert [p.partial_image_index for p in partials] == [0, 1]
    final_image = decode_png(final.b64_json)
    check_final([final_image])
    assert final.size == SIZE and final.output_format == "png"
    assert final.usage is not None
    for partial in partials:
        assert partial.size == SIZE and partial.output_format == "png"
        image = decode_png(partial.b64_json)
        assert image.shape == final_image.shape
        assert not np.array_equal(image, final_image)
        assert np.abs(image.astype(int) - final_image.astype(int)).mean() > 1.0


def generate_kwargs(model_id: str, **kw) -> dict:
    extra = {"num_inference_steps": kw.pop("steps", 4), "seed": kw.pop("seed", 3)}
    return dict(model=model_id, prompt=PROMPT, size=SIZE, response_format="b64_json", extra_body=extra, **kw)


def test_sync_generate(server, model_id):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        models = client.models.list()
        assert [m.id for m in models.data] == [model_id]
        result = client.images.generate(**generate_kwargs(model_id, n=1))
        again = client.images.generate(**generate_kwargs(model_id, n=1))
        other_seed = client.images.generate(**generate_kwargs(model_id, n=1, seed=4))
    assert result.data is not None and len(result.data) == 1
    image = decode_png(result.data[0].b64_json)
    check_final([image])
    assert result.size == SIZE and result.output_format == "png"
    # The seed pins the image; another seed changes it.
    np.testing.assert_array_equal(image, decode_png(again.data[0].b64_json))
    assert not np.array_equal(image, decode_png(other_seed.data[0].b64_json))


def test_sync_generate_n2_gives_distinct_images(server, model_id):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        result = client.images.generate(**generate_kwargs(model_id, n=2))
    assert result.data is not None and len(result.data) == 2
    images = [decode_png(d.b64_json) for d in result.data]
    check_final(images)
    assert np.abs(images[0].astype(int) - images[1].astype(int)).max() > 10


@pytest.mark.asyncio
async def test_async_generate(server, model_id):
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        result = await client.images.generate(**generate_kwargs(model_id, n=1))
    assert result.data is not None and len(result.data) == 1
    image = decode_png(result.data[0].b64_json)
    check_final([image])
    # Same seed and parameters through the sync client give the same pixels.
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        sync = client.images.generate(**generate_kwargs(model_id, n=1))
    np.testing.assert_array_equal(image, decode_png(sync.data[0].b64_json))


def test_sync_stream_partial_images(server, model_id):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        stream = client.images.generate(
            **generate_kwargs(model_id, n=1, steps=STREAM_STEPS), stream=True, partial_images=2
        )
        with stream:
            events = list(stream)
    check_stream(events)
    server.wait_idle()


@pytest.mark.asyncio
async def test_async_stream_partial_images(server, model_id):
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        stream = await client.images.generate(
            **generate_kwargs(model_id, n=1, steps=STREAM_STEPS), stream=True, partial_images=2
        )
        async with stream:
            events = [event async for event in stream]
    check_stream(events)


def test_openai_errors_raise_typed_exceptions(server, model_id):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.images.generate(**generate_kwargs(model_id, n=11))
        with pytest.raises(openai.NotFoundError) as missing:
            client.images.generate(**generate_kwargs("nope", n=1))
    assert bad.value.status_code == 400 and bad.value.param == "n"
    assert missing.value.status_code == 404 and missing.value.param == "model"


def test_openai_client_auth(auth_server, model_id):
    url = f"{auth_server.base_url}/v1"
    with (
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=60) as client,
        pytest.raises(openai.AuthenticationError) as denied,
    ):
        client.images.generate(**generate_kwargs(model_id, n=1))
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=url, api_key="secret", max_retries=0, timeout=60) as client:
        result = client.images.generate(**generate_kwargs(model_id, n=1))
    check_final([decode_png(result.data[0].b64_json)])


@pytest.mark.parametrize("fixture", ["tiny_zimage", "tiny_qwenimage"])
def test_other_families_stream_over_the_openai_api(fixture, request, serve):
    """Z-Image and Qwen-Image through the whole daemon: /v1/models names the family, and a streamed request with a
    negative prompt (CFG for both) gives two partial images decoded by the family's VAE and the final image."""
    server = serve(model=request.getfixturevalue(fixture), max_steps=None)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        (model,) = client.models.list().data
        assert model.model_extra["diffusiond"]["family"] == {"tiny_zimage": "z-image"}.get(fixture, "qwen-image")
        # Fewer steps than the SD3 tests: a random tiny model's predicted image settles early, and late previews
        # would equal the final image.
        kwargs = generate_kwargs(model.id, n=1, steps=8)
        kwargs["extra_body"] |= {"negative_prompt": "blurry", "preview": "vae"}
        with client.images.generate(**kwargs, stream=True, partial_images=2) as stream:
            events = list(stream)
    check_stream(events)
    server.wait_idle()


def test_every_native_field_reaches_the_openai_route_and_an_ignored_knob_is_refused(serve, tiny_qwenimage):
    """Qwen-Image guides by `true_cfg_scale` (with a negative prompt). Before: the OpenAI route took only
    `guidance_scale`, which a checkpoint without a guidance embedding ignores, so `guidance_scale=2.5` silently gave
    the image of true CFG 4.0. Now every per-request field of the native API is an extra body field here too (the
    image equals the native route's), and a `guidance_scale` the checkpoint would ignore is a 400 naming it."""
    import json
    import urllib.request

    server = serve(model=tiny_qwenimage)
    fields = {"negative_prompt": "blurry, dark", "seed": 3, "num_inference_steps": 2}
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:

        def image(**extra) -> np.ndarray:
            result = client.images.generate(prompt=PROMPT, size=SIZE, extra_body={**fields, **extra})
            return decode_png(result.data[0].b64_json)

        low, high = image(true_cfg_scale=2.5), image(true_cfg_scale=4.0)
        with pytest.raises(openai.BadRequestError) as refused:
            image(guidance_scale=2.5)
    assert refused.value.body["param"] == "guidance_scale", refused.value.body
    assert "true_cfg_scale" in refused.value.body["message"]
    assert np.abs(low.astype(int) - high.astype(int)).mean() > 1  # the knob reaches the model
    body = {"prompt": PROMPT, "width": 64, "height": 64, "true_cfg_scale": 2.5, **fields}
    request = urllib.request.Request(
        f"{server.base_url}/v1/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        events = [json.loads(line[5:]) for line in resp.read().decode().splitlines() if line.startswith("data:")]
    assert np.array_equal(low, decode_png(events[-1]["images"][0]["b64"]))
