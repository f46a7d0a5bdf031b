"""Qwen-Image-Layered behind a live server: an answer is one RGBA image per layer. Four native streams started a step
apart (mixed images, prompts, seeds, step counts, CFG with and without its normalization) each give the call's layers
(PNG within 2/255, alpha included) while sharing the transformer's forwards; the official `openai` client's
`images.edit` gets them as `data` (one entry per layer) and, streamed, as one `completed` event per layer; the layer
count comes in `arguments` on both routes, which `/v1/models` lists."""

from __future__ import annotations

import base64
import io
import json

import aiohttp
import diffusers
import numpy as np
import openai
import pytest
import torch
from pictures import picture, translucent
from PIL import Image
from sse import staggered_streams

TIMEOUT = aiohttp.ClientTimeout(total=180)
IMAGES = [translucent(80, 64, seed=1), picture(64, 64, seed=2)]
BODIES = [
    {"prompt": "a red circle", "seed": 1, "num_inference_steps": 4, "arguments": {"layers": 2}},
    {
        "prompt": "a blue square",
        "negative_prompt": "blurry",
        "true_cfg_scale": 3.0,
        "seed": 2,
        "num_inference_steps": 3,
        "arguments": {"layers": 2, "cfg_normalize": True},
    },
    {"prompt": "a cat", "negative_prompt": "a dog", "seed": 3, "num_inference_steps": 5, "arguments": {"layers": 2}},
    {"prompt": "a plain field", "seed": 4, "num_inference_steps": 3, "arguments": {"layers": 2}},
]


def rgba(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG" and image.mode == "RGBA", (image.format, image.mode)
        return np.asarray(image).astype(int)


def expected_layers(pipe, image: bytes, monkeypatch, **fields) -> np.ndarray:
    """The call's layers [layers, H, W, 4] in 0-255, at the requests' 64x64 (standing in for the call's own size)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered

    monkeypatch.setattr(pipeline_qwenimage_layered, "calculate_dimensions", lambda area, ratio: (64, 64))
    arguments = fields.pop("arguments", {})
    out = pipe(
        image=Image.open(io.BytesIO(image)).convert("RGBA"),
        prompt=fields["prompt"],
        negative_prompt=fields.get("negative_prompt"),
        true_cfg_scale=fields.get("true_cfg_scale", 4.0),
        num_inference_steps=fields["num_inference_steps"],
        generator=torch.Generator().manual_seed(fields["seed"]),
        output_type="np",
        **arguments,
    )
    return np.round(np.asarray(out.images[0]) * 255)


@pytest.mark.asyncio
async def test_native_streams_answer_every_layer_and_share_forwards(serve, tiny_qwenimage_layered, monkeypatch):
    server = serve(model=tiny_qwenimage_layered)
    rows: list[int] = []
    transformer = server.state.engine.adapter.transformer
    hook = transformer.register_forward_pre_hook(
        lambda m, a, k: rows.append(k["hidden_states"].shape[0]), with_kwargs=True
    )
    images = [IMAGES[i % 2] for i in range(len(BODIES))]
    bodies = [
        {**b, "width": 64, "height": 64, "image": base64.b64encode(image).decode()}
        for b, image in zip(BODIES, images, strict=True)
    ]
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(f"{server.base_url}/v1/models") as resp:
                (model,) = (await resp.json())["data"]
            ours = model["diffusiond"]
            assert ours["family"] == "qwen-image-layered" and ours["layers"] and ours["alpha"], ours
            assert sorted(ours["arguments"]) == ["cfg_normalize", "layers", "resolution"], ours
            streams = await staggered_streams(session, f"{server.base_url}/v1/generations", bodies)
    finally:
        hook.remove()
    assert max(rows) > 2, rows  # requests shared forwards (two rows each with CFG)
    pipe = diffusers.QwenImageLayeredPipeline.from_pretrained(tiny_qwenimage_layered)
    pipe.set_progress_bar_config(disable=True)
    for body, events, image in zip(BODIES, streams, images, strict=True):
        name, data = events[-1]
        assert name == "completed", events[-1]
        got = np.stack([rgba(base64.b64decode(entry["b64"])) for entry in data["images"]])
        want = expected_layers(pipe, image, monkeypatch, **body)
        assert got.shape == want.shape == (2, 64, 64, 4), (got.shape, want.shape)
        assert float(np.abs(got - want).max()) <= 2, body
        assert len(np.unique(got[..., 3])) > 1  # alpha decoded, not made opaque


def test_openai_client_gets_one_image_per_layer(serve, tiny_qwenimage_layered, monkeypatch):
    """`images.edit` with `arguments` as JSON text (a form's): `data` holds the call's layers in order; streamed,
    one `image_edit.completed` event per layer; `images.generate` without an image is a 400 naming it."""
    server = serve(model=tiny_qwenimage_layered)
    fields = {"num_inference_steps": 3, "seed": 5, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    kwargs = dict(
        image=("a.png", IMAGES[0], "image/png"),
        prompt="a red box",
        size="64x64",
        extra_body={**fields, "arguments": json.dumps({"layers": 3})},
    )
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        result = client.images.edit(**kwargs)
        streamed = [e for e in client.images.edit(**kwargs, stream=True) if e.type == "image_edit.completed"]
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="x", size="64x64")
        assert info.value.body["param"] == "image", info.value.body
    pipe = diffusers.QwenImageLayeredPipeline.from_pretrained(tiny_qwenimage_layered)
    pipe.set_progress_bar_config(disable=True)
    want = expected_layers(pipe, IMAGES[0], monkeypatch, prompt="a red box", arguments={"layers": 3}, **fields)
    got = np.stack([rgba(base64.b64decode(d.b64_json)) for d in result.data])
    assert got.shape == want.shape == (3, 64, 64, 4)
    assert float(np.abs(got - want).max()) <= 2
    assert [e.model_extra["layer"] for e in streamed] == [0, 1, 2]
    assert np.array_equal(np.stack([rgba(base64.b64decode(e.b64_json)) for e in streamed]), got)
