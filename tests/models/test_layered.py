"""Qwen-Image-Layered (`QwenImageLayeredPipeline`): an image decomposed into RGBA layers, step-batched, each
request's layers equal to the pipeline's own `__call__`. Float32 on CPU: max abs diff <= 1e-4.

The call takes no size (the image's aspect at `resolution`²): a request's width and height stand in for it, the
reference's `calculate_dimensions` answering them, except for the request at the default size.
"""

import asyncio
import io

import diffusers
import numpy as np
import pytest
import torch
from engines import run_staggered
from pictures import picture, translucent
from PIL import Image

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams

TOLERANCE = 1e-4


IMAGES = [translucent(80, 64, seed=1), picture(64, 64, seed=2, fmt="JPEG"), translucent(48, 96, seed=3)]


def reference(pipe, params: SamplingParams, monkeypatch, default_size: bool = False, **change) -> np.ndarray:
    """The pipeline's call for one request: its layers [layers, H, W, 4]."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as module

    if not default_size:
        monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: (params.width, params.height))
    else:
        monkeypatch.undo()
    arguments = {**params.arguments, **change.pop("arguments", {})}
    fields = {
        "prompt": params.prompt,
        "negative_prompt": params.negative_prompt,
        "true_cfg_scale": params.true_cfg_scale,
        "num_inference_steps": params.num_inference_steps,
        "image": Image.open(io.BytesIO(params.image)).convert("RGBA"),
        **change,
    }
    out = pipe(**fields, **arguments, generator=torch.Generator().manual_seed(params.seed), output_type="np")
    (layers,) = out.images
    return np.asarray(layers)


def test_layers_match_qwen_image_layered(tiny_qwenimage_layered, monkeypatch):
    """Five staggered decompositions (mixed images, prompts, negative prompts, seeds, step counts, layer counts, CFG
    with and without its normalization, one at the call's own size), each request's layers equal to the call's.
    Two of one size, layer count and CFG share forwards."""
    adapter = load_adapter(tiny_qwenimage_layered)
    assert adapter.family == "qwen-image-layered" and adapter.capabilities.layers
    small = dict(width=64, height=64)
    sent = [
        SamplingParams(prompt="a red box", image=IMAGES[0], seed=1, num_inference_steps=8, **small),
        SamplingParams(
            prompt="a red box",
            negative_prompt="blurry",
            image=IMAGES[1],
            seed=2,
            num_inference_steps=4,
            true_cfg_scale=3.0,
            preview_every=1,
            **small,
        ),
        SamplingParams(
            prompt="a blue sky",
            negative_prompt="",
            image=IMAGES[2],
            seed=3,
            num_inference_steps=3,
            width=48,
            height=80,
            arguments={"layers": 2, "cfg_normalize": True},
        ),
        SamplingParams(prompt="another image", image=IMAGES[1], seed=4, num_inference_steps=2, **small),
        SamplingParams(
            prompt="the call's size", image=IMAGES[0], seed=5, num_inference_steps=2, arguments={"layers": 1}
        ),
    ]
    handles, results, plans = asyncio.run(run_staggered(adapter, sent))
    ids = [h.request_id for h in handles]
    assert any({ids[0], ids[3]} <= set(p.advance) for p in plans)  # one size, four layers, no CFG: shared forwards
    assert (handles[4].params.width, handles[4].params.height) == (704, 576)  # calculate_dimensions(640², 1.25)
    assert [h.params.arguments["layers"] for h in handles] == [4, 4, 2, 4, 1]
    pipe = diffusers.QwenImageLayeredPipeline.from_pretrained(tiny_qwenimage_layered)
    pipe.set_progress_bar_config(disable=True)
    for i, (handle, result) in enumerate(zip(handles, results, strict=True)):
        assert isinstance(result, Completed), result
        params = handle.params
        want = reference(pipe, params, monkeypatch, default_size=i == 4)
        layers = params.arguments["layers"]
        assert result.image.shape == want.shape == (layers, params.height, params.width, 4), result.image.shape
        diff = float(np.abs(result.image - want).max())
        print(f"qwen-image-layered {params.prompt!r} {params.width}x{params.height} x{layers}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{params.prompt!r}: max abs diff {diff}"
    # Not vacuous: another image, prompt, CFG normalization or alpha moves the call's layers past twice the tolerance
    # (measured: 3.3e-4 for the alpha, the least; the requests' own differences are ~1e-6): a family that dropped
    # any of them would fail the equality above.
    first, cfg = handles[0].params, handles[2].params
    for params, result, change in (
        (first, results[0], {"image": Image.open(io.BytesIO(IMAGES[1])).convert("RGBA")}),
        (first, results[0], {"prompt": "a drawing of a dog"}),
        (first, results[0], {"image": Image.open(io.BytesIO(IMAGES[0])).convert("RGB").convert("RGBA")}),
        (cfg, results[2], {"arguments": {"cfg_normalize": False}}),
    ):
        moved = float(np.abs(reference(pipe, params, monkeypatch, **change) - result.image).max())
        assert moved > 2 * TOLERANCE, (change, moved)


def test_layered_requests_are_checked(tiny_qwenimage_layered):
    """The call's switches by name, checked; an image is needed; what the call does not take is refused, named."""
    adapter = load_adapter(tiny_qwenimage_layered)
    resolved = adapter.resolve(SamplingParams(prompt="x", image=IMAGES[2]))
    assert resolved.arguments == {"layers": 4, "resolution": 640, "cfg_normalize": False}
    assert (resolved.width, resolved.height) == (448, 896)  # calculate_dimensions(640², 0.5)
    big = adapter.resolve(SamplingParams(prompt="x", image=IMAGES[2], arguments={"resolution": 1024}))
    assert (big.width, big.height) == (736, 1440)
    for fields, param in (
        ({}, "image"),
        ({"image": IMAGES[0], "strength": 0.5}, "strength"),
        ({"image": IMAGES[0], "reference_images": (IMAGES[1],)}, "reference_images"),
        ({"image": IMAGES[0], "arguments": {"layers": 0}}, "arguments"),
        ({"image": IMAGES[0], "arguments": {"layers": 2.5}}, "arguments"),
        ({"image": IMAGES[0], "arguments": {"resolution": 800}}, "arguments"),
        ({"image": IMAGES[0], "arguments": {"enable_prompt_rewrite": False}}, "arguments"),
        ({"image": b"not an image"}, "image"),
    ):
        with pytest.raises(ParamError) as info:
            adapter.resolve(SamplingParams(prompt="x", width=64, height=64, **fields))
        assert info.value.param == param, (fields, info.value)
