"""Step caches on LTX-2 (models/families/ltx2/cache.py): fbcache, DBCache with TaylorSeer, x0cache over its video and
audio tokens, a decision per row (request, guidance pass, prompt) in every pass's call.

- Threshold 0 is the uncached engine's video and sound (which tests/models/test_ltx2.py holds to the pipeline), for
  requests whose rows run in every pass (CFG, STG, modality) beside requests with fewer.
- In one batch, a request at threshold 0 keeps its exact clip and sound beside one that reuses; the reusing one's
  rows reuse in every pass they run (each row's own cache: with one cache per request, the other passes' rows keep
  none and the test fails), and what it skipped changes its output (a cache that never skips: red).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from caching import count_reuse, run_batch

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

ATOL = 1e-5
CONFIGS = {"fbcache": None, "dbcache": {"fn": 1, "warmup": 2, "taylorseer": True}, "x0cache": None}


def clip(prompt: str, seed: int, steps: int = 6, **more) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=seed, width=64, height=64, num_frames=9, num_inference_steps=steps, **more
    )


# Every pass (CFG with a negative prompt, STG on block 1, modality), and positive rows only.
REQUESTS = [
    clip("a red cat walking", 1, negative_prompt="blurry", stg_blocks=(1,)),
    clip(
        "a yellow fish",
        2,
        steps=5,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
    ),
]


def run(adapter, requests: list[SamplingParams], kept: list | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The requests in one batch: each one's frames and waveform."""
    return [(r.image, r.audio.samples) for r in run_batch(adapter, requests, kept)]


def close(a, b) -> bool:
    return all(np.abs(x - y).max() <= ATOL for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def exact(tiny_ltx2):
    return run(load_adapter(tiny_ltx2), REQUESTS)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_exact_at_zero_and_each_row_reuses_its_own(method, tiny_ltx2, exact, monkeypatch):
    adapter = load_adapter(tiny_ltx2)
    adapter.enable_step_cache(method, 0.0, CONFIGS[method])
    zero = run(adapter, REQUESTS)
    for i, (a, b) in enumerate(zip(exact, zero, strict=True)):
        assert close(a, b), f"request {i}: threshold 0 changed its clip or sound"

    kept: list = []
    reused = count_reuse(monkeypatch)
    cached = msgspec.structs.replace(REQUESTS[0], cache_threshold=10.0)
    mixed = run(adapter, [msgspec.structs.replace(REQUESTS[0], cache_threshold=0.0), cached], kept)
    assert close(mixed[0], exact[0]), "the exact request changed beside a cached one"
    assert sum(reused) > 0, "nothing was reused"
    assert not close(mixed[1], exact[0]), "the cached request skipped nothing"
    state = next(s for s in kept if s.params.cache_threshold == 10.0)
    rows = {"primary": state.cache, **state.row_caches}
    assert set(rows) == {"primary", ("cfg", "negative"), (("stg", (1,)), "positive"), ("modality", "positive")}
    assert all(c.reused > 0 for c in rows.values()), {k: c.reused for k, c in rows.items()}


def test_image_to_video_rows_reuse_with_a_timestep_per_token(tiny_ltx2, monkeypatch):
    """Image to video: the first frame's tokens at timestep 0, so the blocks' modulations are per token ([R, S_v, D])
    and a sub-batch narrows them with its rows. Threshold 0 exact; reuse changes the clip."""
    from pictures import picture

    image = picture(64, 64, seed=1)
    requests = [clip("a red cat walking", 1, image=image), clip("a blue dog", 2, steps=5, image=image)]
    exact = run(load_adapter(tiny_ltx2), requests)
    adapter = load_adapter(tiny_ltx2)
    adapter.enable_step_cache("dbcache", 0.0, CONFIGS["dbcache"])
    zero = run(adapter, requests)
    assert all(close(a, b) for a, b in zip(exact, zero, strict=True)), "threshold 0 changed a clip"
    reused = count_reuse(monkeypatch)
    mixed = run(adapter, [requests[0], msgspec.structs.replace(requests[1], cache_threshold=10.0)])
    assert close(mixed[0], exact[0]) and sum(reused) > 0 and not close(mixed[1], exact[1])
