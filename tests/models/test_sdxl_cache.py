"""x0cache on SDXL's UNet (models/families/sdxl.py `_x0cache_forward`): a request that holds its clean image skips the
whole UNet, and its output is the one its own scheduler maps to that image at this step
(`SchedulerSampler.output_for`), whatever the parametrisation.

- `output_for` inverts `predicted_x0` for epsilon, v and flow prediction, Karras-style and alpha schedules, and EDM's
  preconditioning.
- Threshold 0 is the uncached image (which tests/models/test_sdxl.py holds to the pipeline); in one batch a request
  at 0 keeps it beside one at 10, whose reused steps leave the UNet's call (fewer rows through it: a cache that
  never skips fails) and change its image.
"""

from __future__ import annotations

import diffusers
import msgspec
import numpy as np
import pytest
import torch
from caching import count_reuse, run_batch

from diffusiond.models.flowmatch.sampler import SchedulerSampler
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

ATOL = 1e-5
SCHEDULERS = [
    ("EulerDiscreteScheduler", {}),
    ("EulerDiscreteScheduler", {"prediction_type": "v_prediction"}),
    ("DDIMScheduler", {}),
    ("DDIMScheduler", {"prediction_type": "v_prediction"}),
    ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    ("UniPCMultistepScheduler", {"prediction_type": "flow_prediction", "use_flow_sigmas": True}),
    ("EDMEulerScheduler", {}),
]


@pytest.mark.parametrize(("cls", "overrides"), SCHEDULERS)
def test_output_for_inverts_predicted_x0(cls, overrides, tiny_sdxl):
    config = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl).scheduler.config
    scheduler = getattr(diffusers, cls)
    # EDM's own defaults (SDXL's config has no sigma_data); the others as a user's SDXL checkpoint would set them.
    scheduler = scheduler() if cls.startswith("EDM") else scheduler.from_config(config, **overrides)
    sampler = SchedulerSampler(scheduler, 8, "cpu")
    sampler.index = 3
    x, x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).unbind(0)
    out = sampler.output_for(x[None], x0[None])
    np.testing.assert_allclose(sampler.predicted_x0(x[None], out).numpy(), x0[None].numpy(), atol=1e-4)
    assert float((sampler.predicted_x0(x[None], out + 0.1) - x0).abs().max()) > 1e-3  # not the identity


REQUESTS = [
    SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=8, guidance_scale=5.0),
    SamplingParams(
        prompt="a blue square", negative_prompt="blurry", seed=2, width=64, height=64, num_inference_steps=6
    ),
]


def run(adapter, requests) -> tuple[list[np.ndarray], int]:
    """The images of the requests run in one batch, and the rows that went through the UNet."""
    rows = [0]
    forward = adapter.transformer.forward

    def counting(sample, *args, **kwargs):
        rows[0] += sample.shape[0]
        return forward(sample, *args, **kwargs)

    adapter.transformer.forward = counting
    try:
        results = run_batch(adapter, requests)
    finally:
        del adapter.transformer.forward
    return [r.image for r in results], rows[0]


def test_held_steps_leave_the_unet(tiny_sdxl, monkeypatch):
    exact, exact_rows = run(load_adapter(tiny_sdxl), REQUESTS)
    adapter = load_adapter(tiny_sdxl)
    adapter.enable_step_cache("x0cache", 0.0)
    zero, zero_rows = run(adapter, REQUESTS)
    for a, b in zip(exact, zero, strict=True):
        assert np.abs(a - b).max() <= ATOL, "threshold 0 changed an image"
    assert zero_rows == exact_rows
    reused = count_reuse(monkeypatch)
    mixed, rows = run(adapter, [REQUESTS[0], msgspec.structs.replace(REQUESTS[0], cache_threshold=10.0)])
    assert np.abs(mixed[0] - exact[0]).max() <= ATOL, "the exact request changed beside a cached one"
    assert sum(reused) > 0 and np.abs(mixed[1] - exact[0]).max() > 1e-3, "the cached request skipped nothing"
    assert rows == 2 * 8 * 2 - 2 * sum(reused), (rows, sum(reused))  # two CFG rows a step, none on a held one
