"""SDXL with the schedulers its users pick: each request keeps its own copy, stepped by the scheduler's own `step`
(DPM++ 2M keeps previous outputs, Euler ancestral draws noise from the request's generator every step), while the
requests share every UNet forward. Parity with StableDiffusionXLPipeline `__call__`, fp32 CPU, max abs diff <= 1e-4.
"""

import asyncio

import diffusers
import msgspec
import numpy as np
import pytest
from engines import reference, run_staggered
from pictures import decoded, mask, picture

from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

TOLERANCE = 1e-4
SCHEDULERS = {
    "dpm++2m": ("DPMSolverMultistepScheduler", {}),
    "dpm++2m-karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "euler-ancestral": ("EulerAncestralDiscreteScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
}
REQUESTS = [
    SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=8, guidance_scale=5.0),
    SamplingParams(
        prompt="a blue square",
        negative_prompt="blurry",
        seed=2,
        width=64,
        height=64,
        num_inference_steps=5,
        guidance_scale=7.0,
        preview_every=2,
    ),
    SamplingParams(prompt="a green tree", seed=3, width=64, height=64, num_inference_steps=6, guidance_scale=3.0),
    SamplingParams(prompt="a cat", seed=4, width=64, height=64, num_inference_steps=4, guidance_scale=5.0),
    # Inpainting: after every step the kept region is the image noised by the scheduler's own `add_noise`.
    SamplingParams(
        prompt="a red cat",
        image=picture(80, 64, seed=1),
        mask=mask(80, 64, (0, 0, 40, 64))[0],
        strength=0.7,
        seed=5,
        width=64,
        height=64,
        num_inference_steps=7,
        guidance_scale=5.0,
    ),
]


@pytest.fixture(scope="module")
def checkpoints(tiny_sdxl, tmp_path_factory):
    """The tiny SDXL saved once per scheduler, as a user's checkpoint with that scheduler would be."""
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    out = {}
    for name, (cls, overrides) in SCHEDULERS.items():
        pipe.scheduler = getattr(diffusers, cls).from_config(pipe.scheduler.config, **overrides)
        path = tmp_path_factory.mktemp("sdxl") / name
        pipe.save_pretrained(path)
        out[name] = str(path)
    return out


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_every_scheduler_matches_the_pipeline(scheduler, checkpoints):
    checkpoint = checkpoints[scheduler]
    adapter = load_adapter(checkpoint)
    handles, results, plans = asyncio.run(run_staggered(adapter, REQUESTS))
    assert max(len(p.advance) for p in plans) >= 3, "requests did not share forwards"
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.scheduler).__name__ == SCHEDULERS[scheduler][0]
    inpaint = diffusers.StableDiffusionXLInpaintPipeline.from_pipe(pipe)
    for handle, result in zip(handles, results, strict=True):
        assert isinstance(result, Completed), result
        params = handle.params
        if params.mask is None:
            expected = reference(pipe, "sdxl", params)
        else:
            white = mask(80, 64, (0, 0, 40, 64))[1]
            extra = dict(image=decoded(params.image), mask_image=white, strength=params.strength)
            expected = reference(inpaint, "sdxl", params, **extra)
        diff = float(np.abs(result.image - expected).max())
        print(f"sdxl/{scheduler} {handle.params.prompt!r}: max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, f"{scheduler} {handle.params.prompt!r}: max abs diff {diff}"


def test_img2img_runs_the_steps_each_pipeline_runs(tiny_sdxl, tiny_sd3):
    """50 steps at strength 0.56: SDXL's Img2Img pipeline runs 28, the flow-matching ones 29 (`get_timesteps`
    rounds differently); each family resolves its own pipeline's count."""
    params = SamplingParams(prompt="x", image=picture(64, 64), strength=0.56, num_inference_steps=50)
    for checkpoint, img2img in (
        (tiny_sdxl, "StableDiffusionXLImg2ImgPipeline"),
        (tiny_sd3, "StableDiffusion3Img2ImgPipeline"),
    ):
        pipe = getattr(diffusers, img2img).from_pretrained(checkpoint)
        pipe.scheduler.set_timesteps(50)
        _, runs = pipe.get_timesteps(50, 0.56, "cpu")
        assert load_adapter(checkpoint).resolve(params).steps_to_run == runs
    assert runs == 29 and load_adapter(tiny_sdxl).resolve(params).steps_to_run == 28
    # Without a strength: the Img2Img pipeline's default, or with a mask the Inpaint pipeline's.
    sdxl = load_adapter(tiny_sdxl)
    plain = SamplingParams(prompt="x", image=picture(64, 64))
    assert sdxl.resolve(plain).strength == 0.3
    assert sdxl.resolve(msgspec.structs.replace(plain, mask=mask(64, 64, (0, 0, 8, 8))[0])).strength == 0.9999


def test_second_order_schedulers_go_to_the_generic_path(tiny_sdxl, tmp_path):
    """The family runs one forward per step; a second-order scheduler's checkpoint is served by its pipeline's own
    call instead (tests/models/test_generic_fallback.py checks its images), the reason kept."""
    from diffusiond.models.generic.adapter import GenericAdapter

    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    pipe.scheduler = diffusers.HeunDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.save_pretrained(tmp_path)
    adapter = load_adapter(str(tmp_path))
    assert isinstance(adapter, GenericAdapter) and "HeunDiscreteScheduler is a second-order scheduler" in adapter.reason
