"""Step caching on Wan (models/stepcache/forwards.py `wan_forward`): every method decides per request inside a batch,
on the layouts Wan ships (2.1 text-to-video, 2.1 image-to-video with image cross-attention, 2.2 A14B's two experts,
2.2 TI2V-5B's timestep per token), and nothing crosses Wan 2.2's expert switch (`stepcore.restart`).

- Threshold 0 equals the uncached engine's clip (which tests/models/test_wan.py holds to diffusers' pipelines).
- A batch that mixes thresholds 0, mid and high and different step counts gives every request the clip it gets
  alone, and the cached requests do skip blocks (a batch-wide decision fails the same check in test_stepcache.py).
- At the switch a request's first step on the low-noise expert computes; with the restart removed (broken on
  purpose) it reuses the high-noise expert's residuals instead, and the test sees that.
2 ranks (CFG-parallel, Ulysses) against 1: tests/engine/test_spmd.py `test_step_cache_decisions_agree_across_ranks`.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from caching import ATOL, count_reuse, run
from pictures import picture

from diffusiond.models.base import RequestState
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import core as stepcore
from diffusiond.models.stepcache import methods as stepcache

FIXTURES = {"wan": "tiny_wan", "wan-i2v": "tiny_wan_i2v", "wan22": "tiny_wan22", "wan22-ti2v": "tiny_wan22_ti2v"}
CONFIGS = {"magcache": {"ratios": [1.0, 1.02, 0.98, 1.0]}}
CASES = [
    *(("wan22", m) for m in ("fbcache", "teacache", "x0cache", "magcache", "dbcache")),
    ("wan", "fbcache"),
    ("wan-i2v", "dbcache"),  # sub-batches narrow the reused text and image projections
    ("wan22-ti2v", "teacache"),  # a modulation per token
]


def clip(layout: str, seed: int, steps: int = 8, threshold: float | None = None) -> SamplingParams:
    # TI2V takes an image or not in the same batch; image-to-video always does. Odd seeds use CFG.
    image = layout == "wan-i2v" or (layout == "wan22-ti2v" and seed % 2)
    return SamplingParams(
        prompt=f"a shape {seed}",
        seed=seed,
        width=64 if layout == "wan22-ti2v" else 48,
        height=32,
        num_frames=5,
        num_inference_steps=steps,
        guidance_scale=5.0 if seed % 2 else 1.0,
        cache_threshold=threshold,
        image=picture(48, 32, seed=seed) if image else None,
    )


@pytest.mark.parametrize(("layout", "method"), CASES)
def test_each_request_decides_alone(layout, method, request, monkeypatch):
    model = request.getfixturevalue(FIXTURES[layout])
    plain = load_adapter(model)
    cached = load_adapter(model)
    cached.enable_step_cache(method, 0.0, CONFIGS.get(method))
    exact = asyncio.run(run(plain, [clip(layout, 1), clip(layout, 2, steps=6)], together=True))
    zero = asyncio.run(run(cached, [clip(layout, 1), clip(layout, 2, steps=6)], together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg="threshold 0 changed the clip")

    reused = count_reuse(monkeypatch)
    mix = [clip(layout, 1, threshold=0.0), clip(layout, 2, threshold=10.0), clip(layout, 3, threshold=0.5)]
    mix.append(clip(layout, 4, steps=5))
    together = asyncio.run(run(cached, mix, together=True))
    assert sum(reused) > 0, "nothing was reused: the test would not show anything"
    alone = asyncio.run(run(cached, mix, together=False))
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"request {i}: the batch changed its clip")
    np.testing.assert_allclose(together[0], exact[0], atol=ATOL)
    second = asyncio.run(run(plain, [clip(layout, 2)], together=True))[0]
    assert np.abs(together[1] - second).max() > 1e-3, "the cached request skipped nothing"


def decisions_at_the_switch(adapter, monkeypatch) -> tuple[list[int], list[int]]:
    """One request with every step allowed to reuse: its steps on each expert, and the steps it reused."""
    experts: dict[int, list[int]] = {0: [], 1: []}
    reused: list[int] = []
    original_with, original_reuse = adapter._denoise_with, stepcache.reuse

    def denoise_with(expert, states):
        experts[expert].extend(s.step_index for s in states)
        return original_with(expert, states)

    def reuse(state, change):
        decision = original_reuse(state, change)
        if decision:
            reused.append(state.step_index)
        return decision

    monkeypatch.setattr(adapter, "_denoise_with", denoise_with)
    monkeypatch.setattr(stepcache, "reuse", reuse)
    asyncio.run(run(adapter, [clip("wan22", 1, steps=10, threshold=10.0)], together=True))
    return experts[1], reused


@pytest.mark.parametrize("method", ["fbcache", "magcache"])
def test_nothing_crosses_the_expert_switch(method, tiny_wan22, monkeypatch):
    adapter = load_adapter(tiny_wan22)
    adapter.enable_step_cache(method, 0.0, CONFIGS.get(method))
    low, reused = decisions_at_the_switch(adapter, monkeypatch)
    switch = low[0]
    assert 1 < switch < 8, low  # both experts run several steps
    assert switch not in reused and switch - 1 in reused and switch + 1 in reused, (switch, reused)

    # Broken on purpose: the high-noise expert's history carried over; the switch step reuses it.
    monkeypatch.setattr(stepcore, "restart", lambda state: None)
    _, carried = decisions_at_the_switch(adapter, monkeypatch)
    assert switch in carried, (switch, carried)


def test_a_restart_keeps_the_reuse_count():
    """The step loop counts reuses as the change of the batch's total (engine/executor.py): a restart mid-forward
    must not make it go down."""
    state = RequestState("r", SamplingParams(prompt="p"), latents=None, sampler=None)
    state.cache = stepcache.RequestCache(signal=None, rest=None, reused=3)
    stepcore.restart(state)
    assert state.cache is None and state.cache_reuses == 3
