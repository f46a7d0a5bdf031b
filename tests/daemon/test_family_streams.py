"""Ovis-Image, LongCat-Image, LongCat-Image-Edit and GLM-Image behind a live server: four native streams started a
step apart (mixed prompts, seeds, negative prompts, step counts and guidance, one without CFG; LongCat's rewrite on and
off, its renormalization on and off; the edits of two images; GLM-Image's quoted glyph text, and no negative prompt:
its pipeline takes none) each equal the pipeline's own `__call__` (PNG within 2/255),
while they share the transformer's forwards (a call carrying more rows than one request's two: one forward per request
would never), and `/v1/models` names the family."""

from __future__ import annotations

import base64
import io

import aiohttp
import numpy as np
import pytest
import torch
from pictures import decoded, picture
from PIL import Image
from sse import staggered_streams

TIMEOUT = aiohttp.ClientTimeout(total=180)

BODIES = [
    {"prompt": "a red circle", "seed": 1, "num_inference_steps": 6, "guidance_scale": 5.0},
    {"prompt": "a blue square on the grass", "negative_prompt": "blurry", "seed": 2, "num_inference_steps": 4},
    {"prompt": "a cat", "seed": 3, "num_inference_steps": 5, "guidance_scale": 3.0, "negative_prompt": "a dog"},
    {"prompt": "a plain field", "seed": 4, "num_inference_steps": 3, "guidance_scale": 1.0},
]
# family -> (fixture, pipeline class, its default guidance, each body's call switches)
FAMILIES = {
    "ovis-image": ("tiny_ovis", "OvisImagePipeline", 5.0, [{}] * 4),
    "longcat-image": (
        "tiny_longcat",
        "LongCatImagePipeline",
        4.5,
        [
            {"enable_prompt_rewrite": False},
            {},
            {"enable_prompt_rewrite": False, "enable_cfg_renorm": False},
            {"enable_prompt_rewrite": False},
        ],
    ),
    "longcat-image-edit": ("tiny_longcat_edit", "LongCatImageEditPipeline", 4.5, [{}] * 4),
    "glm-image": ("tiny_glm_image", "GlmImagePipeline", 1.5, [{}] * 4),
}
# GLM-Image's bodies: no negative prompt (its pipeline takes none); quoted text its glyph encoder reads.
GLM_PROMPTS = ["a red circle", "a sign that says 'open'", 'a "cat" on the grass', "a plain field"]
# The edit family's images (two of one aspect, two of another), sent base64 in the native body.
EDITS = [picture(80, 64, seed=1), picture(64, 64, seed=2), picture(160, 128, seed=3), picture(64, 64, seed=4)]


@pytest.mark.asyncio
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_staggered_streams_equal_the_pipeline_and_share_forwards(serve, family, request, monkeypatch):
    import diffusers
    from diffusers.pipelines.longcat_image import pipeline_longcat_image_edit

    fixture, pipeline_class, default_guidance, switches = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    server = serve(model=path)
    rows: list[int] = []
    transformer = server.state.engine.adapter.transformer
    hook = transformer.register_forward_pre_hook(
        lambda m, a, k: rows.append(k["hidden_states"].shape[0]), with_kwargs=True
    )
    edits = family.endswith("-edit")
    if family == "glm-image":
        bodies = zip(BODIES, GLM_PROMPTS, strict=True)
        base = [{**{k: v for k, v in b.items() if k != "negative_prompt"}, "prompt": p} for b, p in bodies]
    else:
        base = BODIES
    bodies = [
        {
            **b,
            "width": 64,
            "height": 64,
            **({"arguments": s} if s else {}),
            **({"image": base64.b64encode(image).decode()} if edits else {}),
        }
        for b, s, image in zip(base, switches, EDITS, strict=True)
    ]
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(f"{server.base_url}/v1/models") as resp:
                (model,) = (await resp.json())["data"]
            assert model["diffusiond"]["family"] == family
            # The call switches a request may set by name (LongCat-Image's), in /v1/models and the document.
            async with session.get(f"{server.base_url}/openapi.json") as resp:
                document = await resp.json()
            arguments = document["components"]["schemas"]["GenerationRequest"]["properties"]["arguments"]
            keyed = [
                o["propertyNames"]["enum"] for o in arguments.get("anyOf", [arguments]) if o.get("type") == "object"
            ]
            switches_taken = sorted({k for s in switches for k in s})
            if switches_taken:
                assert sorted(model["diffusiond"]["arguments"]) == sorted(keyed[0]) and set(switches_taken) <= set(
                    keyed[0]
                )
            else:
                assert "arguments" not in model["diffusiond"] and not keyed, arguments
            streams = await staggered_streams(session, f"{server.base_url}/v1/generations", bodies)
    finally:
        hook.remove()
    assert max(rows) > 2, rows  # requests shared forwards (two rows each with CFG)
    pipe = getattr(diffusers, pipeline_class).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    # The edit pipeline takes no size (its output: the image's aspect at 1024x1024's area); the requests' 64x64 stands
    # in for that size everywhere the pipeline reads it (models/families/longcat.py).
    monkeypatch.setattr(pipeline_longcat_image_edit, "calculate_dimensions", lambda area, ratio: (64, 64))
    for body, events, image in zip(bodies, streams, EDITS, strict=True):
        name, data = events[-1]
        assert name == "completed", events[-1]
        negative = {} if family == "glm-image" else {"negative_prompt": body.get("negative_prompt", "")}
        expected = pipe(
            prompt=body["prompt"],
            **negative,
            guidance_scale=body.get("guidance_scale", default_guidance),
            num_inference_steps=body["num_inference_steps"],
            generator=torch.Generator().manual_seed(body["seed"]),
            output_type="np",
            **({"image": decoded(image)} if edits else {"width": 64, "height": 64}),
            **body.get("arguments", {}),
        ).images[0]
        png = base64.b64decode(data["images"][0]["b64"])
        got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(float)
        assert float(np.abs(got - np.round(expected * 255)).max()) <= 2, body
