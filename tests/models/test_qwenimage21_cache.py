"""Step caches on Qwen-Image 2.1 (models/families/qwenimage21.py `cached_forward`, models/stepcache/span.py): a
decision per row, where a step runs one call per text layout, so a request's positive and negative rows may run in
calls of their own beside other requests' rows; the cached stream is the whole joint sequence (text, condition
image, target), whose modulation has a shared t = 0 row (`causal_condition`) that every sub-batch keeps.

- Threshold 0 is the uncached engine's image (which tests/models/test_parity.py holds to the pipeline), for a
  request with true CFG (its negative prompt of another length) beside one conditioned on an image and one without
  CFG.
- In one batch a request at threshold 0 keeps its exact image beside one at 10, whose positive and negative rows each
  reuse from their own caches (one cache per request: red), and what it skipped changes its image (a cache that never
  skips: red).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from caching import count_reuse, run_batch
from pictures import picture

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

ATOL = 1e-5
CONFIGS = {
    "fbcache": None,
    "dbcache": {"fn": 1, "warmup": 1, "taylorseer": True},
    "x0cache": None,
    "magcache": {"ratios": [1.0, 1.02, 0.98, 1.0]},
}
GUIDED = SamplingParams(
    prompt="a red circle",
    negative_prompt="blurry and dark",
    seed=1,
    width=64,
    height=64,
    num_inference_steps=6,
    true_cfg_scale=4.0,
)
REQUESTS = [
    GUIDED,
    SamplingParams(prompt="a red square", seed=2, width=64, height=64, num_inference_steps=5),
]


def run(adapter, requests, kept: list | None = None) -> list[np.ndarray]:
    return [r.image for r in run_batch(adapter, requests, kept)]


@pytest.fixture(scope="module")
def exact(tiny_qwenimage21):
    return run(load_adapter(tiny_qwenimage21), REQUESTS)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_exact_at_zero_and_each_row_reuses_its_own(method, tiny_qwenimage21, exact, monkeypatch):
    adapter = load_adapter(tiny_qwenimage21)
    adapter.enable_step_cache(method, 0.0, CONFIGS[method])
    zero = run(adapter, REQUESTS)
    for i, (a, b) in enumerate(zip(exact, zero, strict=True)):
        assert np.abs(a - b).max() <= ATOL, f"request {i}: threshold 0 changed its image"
    reused = count_reuse(monkeypatch)
    kept: list = []
    cached = msgspec.structs.replace(GUIDED, cache_threshold=10.0)
    mixed = run(adapter, [msgspec.structs.replace(GUIDED, cache_threshold=0.0), cached], kept)
    assert np.abs(mixed[0] - exact[0]).max() <= ATOL, "the exact request changed beside a cached one"
    assert sum(reused) > 0 and np.abs(mixed[1] - exact[0]).max() > 1e-3, "the cached request skipped nothing"
    state = next(s for s in kept if s.params.cache_threshold == 10.0)
    assert set(state.row_caches) == {1} and state.cache.reused > 0 and state.row_caches[1].reused > 0


def test_a_condition_image_s_rows_reuse(tiny_qwenimage21, monkeypatch):
    """With an image (its tokens in the prefix, modulated at t = 0), exact at 0 and reusing at 10."""
    edit = SamplingParams(
        prompt="make it blue", image=picture(64, 48, seed=3), seed=7, width=64, height=64, num_inference_steps=5
    )
    (expected,) = run(load_adapter(tiny_qwenimage21), [edit])
    adapter = load_adapter(tiny_qwenimage21)
    adapter.enable_step_cache("fbcache", 0.0)
    (zero,) = run(adapter, [edit])
    assert np.abs(zero - expected).max() <= ATOL
    reused = count_reuse(monkeypatch)
    (cached,) = run(adapter, [msgspec.structs.replace(edit, cache_threshold=10.0)])
    assert sum(reused) > 0 and np.abs(cached - expected).max() > 1e-3
