"""DBCache, decided per request inside a batch (models/stepcache/methods.py `_dbcache`, issue 35): the first `fn` blocks
run for every row and their residual decides, the middle blocks run only for the requests that compute, the last `bn`
blocks run for every row again; no request reuses before step `warmup`. On deeper tiny SD3 (5 blocks, the last of
which takes the text tokens only) and FLUX.1 (2 double-stream and 3 single-stream blocks: the reused span crosses from
one kind to the other) checkpoints, saved and loaded through `from_pretrained`, with fn=2, bn=1, warmup=2.

- Threshold 0 equals the uncached engine's image (tests/models/test_parity.py holds that to diffusers).
- A batch mixing thresholds and step counts gives each request its image alone, and the cached ones really reuse.
- Which rows go through which block, forward by forward: a middle that ran every row (nothing skipped), last blocks
  skipped for reusing rows, or a warm-up ignored each fail here.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from caching import ATOL, count_reuse, params, run

from diffusiond.daemon.config import ConfigError
from diffusiond.daemon.startup import cache_settings
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.stepcache import core as stepcore
from diffusiond.models.stepcache import methods as stepcache

CONFIG = {"fn": 2, "bn": 1, "warmup": 2}


@pytest.fixture(scope="module", params=["sd3", "flux"])
def deep(request) -> tuple[str, str]:
    return request.param, request.getfixturevalue(f"tiny_{request.param}_deep")


@pytest.fixture(scope="module")
def plain(deep):
    return load_adapter(deep[1])


@pytest.fixture(scope="module")
def cached(deep):
    adapter = load_adapter(deep[1])
    adapter.enable_step_cache("dbcache", 0.0, CONFIG)
    assert (adapter.cache.method.fn, adapter.cache.method.bn, adapter.cache.method.warmup) == (2, 1, 2)
    return adapter


def blocks(adapter) -> list:
    t = adapter.transformer
    return [*t.transformer_blocks, *getattr(t, "single_transformer_blocks", ())]


def test_threshold_zero_is_exact(plain, cached):
    requests = [params(1), params(2, steps=5)]
    exact = asyncio.run(run(plain, requests, together=True))
    zero = asyncio.run(run(cached, requests, together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_each_request_decides_alone(cached, plain, monkeypatch):
    reused = count_reuse(monkeypatch)
    mix = [params(1, threshold=0.0), params(2, threshold=10.0), params(3, threshold=0.5), params(4, steps=5)]
    together = asyncio.run(run(cached, mix, together=True))
    assert sum(reused) > 0, "nothing was reused: the test would not show anything"
    alone = asyncio.run(run(cached, mix, together=False))
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"request {i}: the batch changed its image")
    exact = asyncio.run(run(plain, [params(1), params(2)], together=False))
    np.testing.assert_allclose(together[0], exact[0], atol=ATOL)
    assert np.abs(together[1] - exact[1]).max() > 1e-3


def test_rows_through_each_block(deep, cached, monkeypatch):
    """Two requests of 6 steps in one batch, one reusing whenever it may (threshold 10), one exact. Every forward:
    the first two blocks and the last see both requests' rows; the middle ones only the computing request's. The
    reusing one reuses at steps 2-4: never at step 0 or its last, nor at step 1 (the warm-up)."""
    family, _ = deep
    rows = 2 if family == "sd3" else 1  # SD3 runs CFG (2 rows a request); FLUX.1 is guidance-distilled
    seen: dict[int, list[int]] = defaultdict(list)  # block -> rows of each call
    hooks = [
        block.register_forward_pre_hook(
            lambda m, a, k, i=i: seen[i].append(k["hidden_states"].shape[0]), with_kwargs=True
        )
        for i, block in enumerate(blocks(cached))
    ]
    decisions: list[tuple[str, int, bool]] = []
    original = stepcache.reuse

    def recording(state, change):
        decisions.append((state.params.prompt, state.step_index, original(state, change)))
        return decisions[-1][2]

    monkeypatch.setattr(stepcache, "reuse", recording)
    try:
        asyncio.run(run(cached, [params(1, steps=6, threshold=10.0), params(2, steps=6, threshold=0.0)], True))
    finally:
        for hook in hooks:
            hook.remove()
    reusing = params(1).prompt
    assert sorted(step for prompt, step, d in decisions if d and prompt == reusing) == [2, 3, 4], decisions
    assert not any(d for prompt, _, d in decisions if prompt != reusing)
    assert all(step >= CONFIG["warmup"] for _, step, _ in decisions), "reuse was asked during the warm-up"
    per_step = [2 * rows - rows * (2 <= step <= 4) for step in range(6)]  # the middle's rows at each forward
    n = len(blocks(cached))
    for i in range(n):
        expected = per_step if CONFIG["fn"] <= i < n - CONFIG["bn"] else [2 * rows] * 6
        assert seen[i] == expected, (i, seen[i])


class Shift(torch.nn.Module):
    """A block whose residuals do not depend on its image input: reusing them is exact when the text input is the
    same. Its image residual depends on the text tokens it is given."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, hidden_states, encoder_hidden_states, temb, **_):
        text = encoder_hidden_states.mean(dim=(1, 2), keepdim=True)
        return encoder_hidden_states * 0.5 + self.k, hidden_states + self.k * text


def test_a_reused_span_adds_its_image_and_text_residuals():
    """The same input twice: the second step reuses the middle blocks, and its output equals the computed one only
    if both residuals of the span were added (the last block reads the text tokens the span made)."""
    shifts = [Shift(1.0), Shift(2.0), Shift(3.0), Shift(4.0)]
    method = stepcore.method_of("dbcache", {"fn": 1, "bn": 1}, len(shifts))
    torch.manual_seed(0)
    h, enc, temb = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.zeros(2, 4)
    state = SimpleNamespace(
        request_id="a",
        params=SimpleNamespace(cache_threshold=0.5, cache_steps=None),
        step_index=0,
        total_steps=5,
        cache=None,
    )
    computed = stepcache.cached_blocks(method, shifts, stepcache.Batch(h, enc, temb, 2, [state]))
    state.step_index = 1
    reused = stepcache.cached_blocks(method, shifts, stepcache.Batch(h, enc, temb, 2, [state]))
    assert (state.cache.computed, state.cache.reused) == (1, 1)
    torch.testing.assert_close(reused, computed, rtol=1e-6, atol=1e-5)  # (sums in another order: rounding)


def test_settings_are_checked():
    assert cache_settings("dbcache", '{"fn": 2, "bn": 1}') == {"fn": 2, "bn": 1}
    for text, message in [
        ('{"fn": 1, "Fn": 2}', "'Fn' unknown to --cache dbcache"),
        ('{"fn": 0}', "fn must be an integer >= 1"),
        ('{"warmup": 1.5}', "warmup must be an integer"),
        ('{"bn": true}', "bn must be an integer"),
        ("[1]", "a JSON object"),
        ("{fn: 1}", "not JSON"),
    ]:
        with pytest.raises(ConfigError, match=message):
            cache_settings("dbcache", text)
    with pytest.raises(ConfigError, match="'fn' unknown to --cache teacache"):
        cache_settings("teacache", '{"fn": 2}')
    with pytest.raises(ValueError, match="leaves none of the transformer's 4 blocks"):
        stepcore.method_of("dbcache", {"fn": 3, "bn": 1}, 4)
