"""The step-cache menu on the edit families (issue 52): Qwen-Image-Edit, -2509 and -2511 (whose input images'
tokens take timestep 0's modulation: each row's modulation pair is narrowed with its rows) and FLUX.2 klein edits
(reference tokens after the latents), decided per request inside a batch.

- Threshold 0 is exact: the cached forward gives the uncached engine's images (which tests/models/test_edits.py
  holds to the pipelines), with true CFG on one request (two rows) beside one without.
- An exact request and a cached one share forwards: the exact one gets the uncached image, the cached one reuses
  (counted), differs from it and equals its image alone.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from caching import ATOL, count_reuse, run
from pictures import picture

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

# Each edit family with one method: the images' encoders and tokens make these slower than the text families'
# (tests/models/test_stepcache.py runs every method on those, FLUX.2 klein's included).
CASES = {
    ("tiny_qwenimage_edit", "fbcache"),
    ("tiny_qwenimage_edit_plus", "x0cache"),
    ("tiny_qwenimage_edit_2511", "teacache"),
    ("tiny_flux2klein", "teacache"),
    ("tiny_qwenimage_layered", "dbcache"),  # four layers' frames and the image's in every forward
}


def edit(seed: int, threshold: float | None = None, **extra) -> SamplingParams:
    # One image size for all: requests share forwards only when their images' latents have the same size.
    return SamplingParams(
        prompt=f"make shape {seed} red" + " and round" * (seed % 2),
        image=picture(64, 64, seed=seed),
        seed=seed,
        width=64,
        height=64,
        num_inference_steps=5,
        cache_threshold=threshold,
        **extra,
    )


@pytest.mark.parametrize(("fixture", "method"), sorted(CASES))
def test_cached_edits(fixture, method, request, monkeypatch):
    checkpoint = request.getfixturevalue(fixture)
    plain, cached = load_adapter(checkpoint), load_adapter(checkpoint)
    cached.enable_step_cache(method, 0.0)
    cfg = {} if cached.family == "flux2-klein" else {"negative_prompt": "blurry", "true_cfg_scale": 3.0}
    exact = asyncio.run(run(plain, [edit(1), edit(2, **cfg)], together=True))
    # Threshold 0: the uncached images.
    zero = asyncio.run(run(cached, [edit(1, 0.0), edit(2, 0.0, **cfg)], together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    # An exact request and a cached one in one batch: the exact one's image unchanged, the cached one reused.
    reused = count_reuse(monkeypatch)
    mixed = asyncio.run(run(cached, [edit(1, 0.0), edit(2, 10.0, **cfg)], together=True))
    assert sum(reused) > 0, "nothing was reused: the test would not show anything"
    np.testing.assert_allclose(mixed[0], exact[0], atol=ATOL)
    assert np.abs(mixed[1] - exact[1]).max() > 1e-3
    (alone,) = asyncio.run(run(cached, [edit(2, 10.0, **cfg)], together=False))
    np.testing.assert_allclose(mixed[1], alone, atol=ATOL, err_msg="the batch changed the cached request's image")
