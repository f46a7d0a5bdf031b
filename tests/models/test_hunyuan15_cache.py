"""Step caches on HunyuanVideo-1.5 (models/families/hunyuan15.py `cached_forward`, models/stepcache/span.py): every
method, a decision per row, where a request's negative row runs only on the steps its guider's range covers (here
the first half: the checkpoint's guider, `stop` 0.5).

- Threshold 0 is the uncached engine's clip (which tests/models/test_hunyuan15.py holds to the pipeline), for a
  request with CFG beside one without.
- In one batch a request at threshold 0 keeps its exact clip beside one at 10, whose positive and negative rows each
  reuse from their own caches (one cache per request: the negative row keeps none, red), and what it skipped changes
  its clip (a cache that never skips: red).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from caching import count_reuse, run_batch

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

ATOL = 1e-5
CONFIGS = {
    "fbcache": None,
    "dbcache": {"fn": 1, "warmup": 1, "taylorseer": True},
    "teacache": None,
    "x0cache": None,
    "magcache": {"ratios": [1.0, 1.02, 0.98, 1.0]},
}
REQUESTS = [
    SamplingParams(prompt="a red cat walking", seed=1, width=64, height=64, num_frames=5, num_inference_steps=6),
    SamplingParams(
        prompt="a blue dog", seed=2, width=64, height=64, num_frames=5, num_inference_steps=5, guidance_scale=1.0
    ),
]


def loaded(checkpoint: str):
    adapter = load_adapter(checkpoint)
    adapter.guider._stop = 0.5  # a step range: the negative row only on the first half of the steps
    return adapter


def run(adapter, requests, kept: list | None = None) -> list[np.ndarray]:
    return [r.image for r in run_batch(adapter, requests, kept)]


@pytest.fixture(scope="module")
def exact(tiny_hunyuan15):
    return run(loaded(tiny_hunyuan15), REQUESTS)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_exact_at_zero_and_each_row_reuses_its_own(method, tiny_hunyuan15, exact, monkeypatch):
    adapter = loaded(tiny_hunyuan15)
    adapter.enable_step_cache(method, 0.0, CONFIGS[method])
    zero = run(adapter, REQUESTS)
    for i, (a, b) in enumerate(zip(exact, zero, strict=True)):
        assert np.abs(a - b).max() <= ATOL, f"request {i}: threshold 0 changed its clip"
    reused = count_reuse(monkeypatch)
    kept: list = []
    cached = msgspec.structs.replace(REQUESTS[0], cache_threshold=10.0)
    mixed = run(adapter, [msgspec.structs.replace(REQUESTS[0], cache_threshold=0.0), cached], kept)
    assert np.abs(mixed[0] - exact[0]).max() <= ATOL, "the exact request changed beside a cached one"
    assert sum(reused) > 0 and np.abs(mixed[1] - exact[0]).max() > 1e-3, "the cached request skipped nothing"
    state = next(s for s in kept if s.params.cache_threshold == 10.0)
    assert set(state.row_caches) == {"negative"}
    assert state.cache.reused > 0 and state.row_caches["negative"].reused > 0
