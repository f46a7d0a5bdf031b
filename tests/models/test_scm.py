"""SCM step masks (models/stepcache/methods.py `scm_steps`, issue 35): per request, the steps that compute whatever the
cache's signal says (`cache_steps`: "fast", "medium", "slow", "off" or step indices; the server's default from
`--cache-config '{"scm": ...}'`); the other steps reuse while the signal allows.

- The presets: Cache-DiT's 28-step masks, stretched to a request's steps with their lone computed steps kept.
- On tiny SD3 with fbcache at a threshold that reuses whenever it may: each request computes exactly its mask's steps
  (a mask ignored: red), threshold 0 is exact with a mask, and a batch of requests with different masks and step
  counts gives each its image alone.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from caching import ATOL, params, run

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError
from diffusiond.models.stepcache import methods as stepcache
from diffusiond.models.stepcache.settings import scm_steps


def test_presets_and_lists():
    # At 28 steps, Cache-DiT's masks: 18, 15 and 11 computed steps.
    assert scm_steps("slow", 28) == (0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 14, 15, 16, 19, 20, 23, 27)
    assert scm_steps("medium", 28) == (0, 1, 2, 3, 4, 5, 7, 8, 12, 13, 17, 18, 22, 23, 27)
    assert scm_steps("fast", 28) == (0, 1, 2, 3, 4, 5, 7, 11, 16, 22, 27)
    # Stretched: fewer steps keep one step of each computed run; more keep the share.
    assert scm_steps("fast", 20) == (0, 1, 2, 3, 5, 8, 11, 15, 19)
    for n in (16, 20, 50):
        fast, medium, slow = (len(scm_steps(m, n)) for m in ("fast", "medium", "slow"))
        assert fast <= medium < slow < n, (n, fast, medium, slow)
    assert len(scm_steps("fast", 50)) / 50 == pytest.approx(11 / 28, abs=0.02)
    assert scm_steps([3, 5, 40], 20) == (0, 3, 5, 19)  # with the first and last; steps past the end dropped
    assert scm_steps("off", 20) is None


@pytest.fixture(scope="module")
def cached(tiny_sd3):
    adapter = load_adapter(tiny_sd3)
    adapter.enable_step_cache("fbcache", 0.0)
    return adapter


def masked(seed: int, steps: int, mask, threshold: float = 10.0):
    return msgspec.structs.replace(params(seed, steps=steps, threshold=threshold), cache_steps=mask)


def test_each_request_computes_its_mask(cached, monkeypatch):
    decisions: dict[str, list[int]] = {}
    original = stepcache.reuse

    def recording(state, change):
        decision = original(state, change)
        decisions.setdefault(state.params.prompt, [])
        if not decision:
            decisions[state.params.prompt].append(state.step_index)
        return decision

    monkeypatch.setattr(stepcache, "reuse", recording)
    mix = [masked(1, 8, [0, 3, 4]), masked(2, 10, "fast"), masked(3, 8, None), masked(4, 8, "off")]
    together = asyncio.run(run(cached, mix, together=True))
    computed = {p.prompt: decisions[p.prompt] for p in mix}
    # The first and the last step always compute.
    assert computed[mix[0].prompt] == [0, 3, 4, 7], computed
    assert computed[mix[1].prompt] == list(scm_steps("fast", 10)), computed
    assert computed[mix[2].prompt] == computed[mix[3].prompt] == [0, 7], computed  # no mask: reuses whenever it may
    alone = asyncio.run(run(cached, mix, together=False))
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"request {i}: the batch changed its image")
    assert np.abs(together[0] - together[2]).max() > 1e-3, "the mask changed nothing"


def test_threshold_zero_is_exact_with_a_mask(cached, tiny_sd3):
    exact = asyncio.run(run(load_adapter(tiny_sd3), [params(1)], together=False))
    zero = asyncio.run(run(cached, [masked(1, 8, "fast", threshold=0.0)], together=False))
    np.testing.assert_allclose(exact[0], zero[0], atol=ATOL)


def test_the_server_default_and_refusals(tiny_sd3):
    adapter = load_adapter(tiny_sd3)
    with pytest.raises(ParamError, match="without step caching"):
        adapter.resolve(masked(1, 8, "fast"))
    assert adapter.resolve(params(1)).cache_steps is None
    adapter.enable_step_cache("teacache", 0.1, {"scm": "medium"})
    assert adapter.resolve(params(1, steps=20)).cache_steps == scm_steps("medium", 20)
    assert adapter.resolve(masked(1, 20, "off")).cache_steps is None
    assert adapter.resolve(masked(1, 20, (2, 9))).cache_steps == (0, 2, 9, 19)
    with pytest.raises(ParamError, match="step 20 is past the request's 20 steps") as info:
        adapter.resolve(masked(1, 20, (2, 20)))
    assert info.value.param == "cache_steps"
