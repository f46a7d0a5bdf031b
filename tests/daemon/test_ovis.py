"""Ovis-Image behind a live server: four native streams started a step apart (mixed prompts, seeds, negative prompts,
step counts and guidance, one without CFG) each equal the pipeline's own `__call__` (PNG within 2/255), while they
share the transformer's forwards (a call carrying more rows than one request's two: one forward per request would
never), and `/v1/models` names the family."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import numpy as np
import pytest
import torch
from PIL import Image
from sse import sse_events

TIMEOUT = aiohttp.ClientTimeout(total=180)

BODIES = [
    {"prompt": "a red circle", "seed": 1, "num_inference_steps": 6, "guidance_scale": 5.0},
    {"prompt": "a blue square on the grass", "negative_prompt": "blurry", "seed": 2, "num_inference_steps": 4},
    {"prompt": "a cat", "seed": 3, "num_inference_steps": 5, "guidance_scale": 3.0, "negative_prompt": "a dog"},
    {"prompt": "a plain field", "seed": 4, "num_inference_steps": 3, "guidance_scale": 1.0},
]


@pytest.mark.asyncio
async def test_staggered_streams_equal_the_pipeline_and_share_forwards(serve, tiny_ovis):
    import diffusers

    server = serve(model=tiny_ovis)
    rows: list[int] = []
    transformer = server.state.engine.adapter.transformer
    hook = transformer.register_forward_pre_hook(
        lambda m, a, k: rows.append(k["hidden_states"].shape[0]), with_kwargs=True
    )
    bodies = [{**b, "width": 64, "height": 64} for b in BODIES]
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(f"{server.base_url}/v1/models") as resp:
                (model,) = (await resp.json())["data"]
            assert model["diffusiond"]["family"] == "ovis-image"
            started = [asyncio.Event() for _ in bodies]

            async def one(i: int):
                if i:
                    await started[i - 1].wait()

                async def mark(name, data, rid):
                    if name == "progress":
                        started[i].set()

                async with session.post(f"{server.base_url}/v1/generations", json=bodies[i]) as resp:
                    assert resp.status == 200, await resp.text()
                    events = []
                    async for name, data in sse_events(resp):
                        events.append((name, data))
                        await mark(name, data, resp.headers["X-Request-Id"])
                    return events

            streams = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    finally:
        hook.remove()
    assert max(rows) > 2, rows  # requests shared forwards (two rows each with CFG)
    pipe = diffusers.OvisImagePipeline.from_pretrained(tiny_ovis)
    pipe.set_progress_bar_config(disable=True)
    for body, events in zip(bodies, streams, strict=True):
        name, data = events[-1]
        assert name == "completed", events[-1]
        expected = pipe(
            prompt=body["prompt"],
            negative_prompt=body.get("negative_prompt", ""),
            guidance_scale=body.get("guidance_scale", 5.0),
            num_inference_steps=body["num_inference_steps"],
            width=64,
            height=64,
            generator=torch.Generator().manual_seed(body["seed"]),
            output_type="np",
        ).images[0]
        png = base64.b64decode(data["images"][0]["b64"])
        got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(float)
        assert float(np.abs(got - np.round(expected * 255)).max()) <= 2, body
