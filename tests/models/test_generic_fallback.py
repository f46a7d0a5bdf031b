"""The generic path as a second oracle and as a fallback (models/generic/):

- `--adapter generic` on dedicated families (SD3, FLUX.1, Wan): the pipeline's own call, a step at a time, gives the
  images (clips) the dedicated adapter gives;
- a checkpoint of a served class whose layout its family's adapter does not read goes generic at load, with the
  reason logged, and serves what its pipeline makes: a Wan image-to-video transformer with an image embedding but no
  image key/value projections (it killed the daemon at warm-up before), SDXL and SD3 with a second-order scheduler
  (SD3's family made another image with one, silently), Qwen-Image 2.1 with a fixed sampling schedule.
"""

from __future__ import annotations

import asyncio
import logging

import diffusers
import numpy as np
import pytest
import torch
from pictures import picture

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.generic.adapter import GenericAdapter
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams


def served(adapter, requests: list[SamplingParams]) -> list[np.ndarray]:
    """Each request's output through an Engine, all queued together."""

    async def run():
        engine = Engine(adapter, max_batch=4, batch_wait=0.3)
        await engine.start()
        try:
            results = await asyncio.gather(*(engine.add_request(p).result() for p in requests))
        finally:
            await engine.stop()
        assert all(isinstance(r, Completed) for r in results), results
        return [r.image for r in results]

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("fixture", "extra"),
    [
        ("tiny_sd3", {"guidance_scale": 5.0, "negative_prompt": "blurry"}),
        ("tiny_flux", {"guidance_scale": 3.5}),
        ("tiny_wan", {"guidance_scale": 5.0, "num_frames": 5}),
    ],
)
def test_the_generic_path_equals_the_dedicated_one(fixture, extra, request):
    """The same requests (two seeds, batched) through the dedicated family and through `--adapter generic`: the same
    images (frames), within float rounding of the two programs' orders of operations."""
    model = request.getfixturevalue(fixture)
    base = {"width": 64, "height": 64, "num_inference_steps": 3, **extra}
    requests = [SamplingParams(prompt=f"a shape {s}", seed=s, **base) for s in (1, 2)]
    dedicated = load_adapter(model)
    generic = load_adapter(model, adapter="generic")
    assert isinstance(dedicated, FlowMatchAdapter) and isinstance(generic, GenericAdapter)
    for a, b in zip(served(dedicated, requests), served(generic, requests), strict=True):
        assert a.shape == b.shape
        diff = float(np.abs(a - b).max())
        print(f"{fixture}: dedicated vs generic max abs diff {diff:.2e}")
        assert diff <= 1e-4


@pytest.fixture(scope="module")
def sdxl_heun(tiny_sdxl, tmp_path_factory) -> str:
    """SDXL with a second-order scheduler (Heun: two UNet forwards per step), which the sdxl family does not run."""
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    pipe.scheduler = diffusers.HeunDiscreteScheduler.from_config(pipe.scheduler.config)
    out = tmp_path_factory.mktemp("tiny") / "sdxl-heun"
    pipe.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def sd3_heun(tiny_sd3, tmp_path_factory) -> str:
    """SD3 with FlowMatchHeunDiscreteScheduler (second order): the sd3 family ran it as one forward a step and made
    another image (0.54 off), silently."""
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.scheduler = diffusers.FlowMatchHeunDiscreteScheduler.from_config(pipe.scheduler.config)
    out = tmp_path_factory.mktemp("tiny") / "sd3-heun"
    pipe.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def qwen21_fixed_schedule(tiny_qwenimage21, tmp_path_factory) -> str:
    """Qwen-Image 2.1 with a fixed sampling schedule (`sample_sigmas` in its pipeline config)."""
    pipe = diffusers.QwenImage21Pipeline.from_pretrained(tiny_qwenimage21)
    pipe.register_to_config(sample_sigmas=[1.0, 0.7, 0.4])
    out = tmp_path_factory.mktemp("tiny") / "qwen21-fixed"
    pipe.save_pretrained(out)
    return str(out)


def test_a_wan_i2v_layout_the_family_does_not_read_serves_the_pipeline_s_clips(
    tiny_wan_i2v_no_image_projections, caplog
):
    """Before: `AttributeError: 'WanAttention' object has no attribute 'norm_added_k'` at warm-up killed the
    daemon. Now it loads on the generic path, saying why, and an image-to-video request gets the pipeline's clip."""
    model = tiny_wan_i2v_no_image_projections
    with caplog.at_level(logging.WARNING):
        adapter = load_adapter(model)
    assert isinstance(adapter, GenericAdapter) and "added_kv_proj_dim" in (adapter.reason or "")
    assert "generic path" in caplog.text
    caps = adapter.capabilities
    assert caps.modality == "video" and "first-frame" in caps.image_inputs
    image = picture(64, 64)
    p = SamplingParams(prompt="a cat", seed=3, width=64, height=64, num_frames=5, num_inference_steps=2, image=image)
    (clip,) = served(adapter, [p])
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    from PIL import Image

    from diffusiond.models.inputs import open_rgb

    expected = pipe(
        image=open_rgb(image), prompt="a cat", num_frames=5, height=64, width=64, num_inference_steps=2,
        generator=torch.Generator().manual_seed(3), output_type="np",
    ).frames[0]  # fmt: skip
    assert isinstance(open_rgb(image), Image.Image)
    assert clip.shape == expected.shape and float(np.abs(clip - expected).max()) <= 1e-4


@pytest.mark.parametrize(
    ("fixture", "pipeline", "why"),
    [
        ("sdxl_heun", "StableDiffusionXLPipeline", "second-order"),
        ("sd3_heun", "StableDiffusion3Pipeline", "second-order"),
        ("qwen21_fixed_schedule", "QwenImage21Pipeline", "sample_sigmas"),
    ],
)
def test_a_layout_the_family_does_not_read_goes_generic(fixture, pipeline, why, request):
    model = request.getfixturevalue(fixture)
    adapter = load_adapter(model)
    assert isinstance(adapter, GenericAdapter) and why in (adapter.reason or ""), adapter.reason
    p = adapter.resolve(SamplingParams(prompt="a red circle", seed=4, width=64, height=64, num_inference_steps=3))
    (image,) = served(adapter, [p])
    pipe = getattr(diffusers, pipeline).from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        prompt=p.prompt, width=64, height=64, num_inference_steps=3, generator=torch.Generator().manual_seed(4),
        output_type="np",
    ).images[0]  # fmt: skip
    assert float(np.abs(image - expected).max()) <= 1e-4


def test_a_family_whose_package_is_missing_is_refused_naming_it(tmp_path, monkeypatch):
    """An image built without the vision extra has no torchvision: a Qwen-Image-Edit checkpoint is refused at start
    with the package and the extra named (a setup error: exit 2), not a traceback from deep inside its processor."""
    import importlib.util

    from diffusiond.models.loading import loader
    from diffusiond.models.loading.setup import SetupError

    (tmp_path / "model_index.json").write_text('{"_class_name": "QwenImageEditPipeline"}')
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(
        SetupError, match=r"needs torchvision, which is not installed: pip install 'diffusiond\[vision\]'"
    ):
        loader.load_adapter(str(tmp_path))
