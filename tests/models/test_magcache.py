"""MagCache per request (models/stepcache/methods.py `_magcache`, issue 35): after the first `retention` share of its
steps, a request multiplies the checkpoint's magnitude ratios of the steps since it last computed and accumulates
|1 - product|; below its threshold, at most `max_skip` steps in a row, it runs no block and adds the residual of its
last computed step. The ratios: `--cache-config`'s, else the checkpoint's calibration (`python -m
diffusiond.tools.calibrate --method magcache`), else the family's published ones (FLUX.1), else the start is refused.

The generic tests (threshold 0 exact, a mixed batch equal to each request alone, a batch-wide decision caught) run it
in tests/models/test_stepcache.py; 2 ranks equal 1 in tests/engine/test_spmd.py.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from diffusiond.daemon.config import ConfigError
from diffusiond.daemon.startup import cache_settings
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.stepcache import core as stepcore
from diffusiond.models.stepcache import methods as stepcache
from diffusiond.models.stepcache import settings


class Add(torch.nn.Module):
    def forward(self, hidden_states, encoder_hidden_states, temb, **_):
        return encoder_hidden_states, hidden_states + temb.mean(dim=1)[:, None, None]


def decisions(config: dict, steps: int = 10, threshold: float = 0.1) -> list[int]:
    """The steps one request reuses, and checks that a reused step adds its last computed residual."""
    method = stepcore.method_of("magcache", config, 2)
    state = SimpleNamespace(
        request_id="a",
        params=SimpleNamespace(cache_threshold=threshold, cache_steps=None),
        step_index=0,
        total_steps=steps,
        cache=None,
    )
    h, enc = torch.zeros(1, 3, 4), torch.zeros(1, 2, 4)
    reused, last_computed = [], None
    for step in range(steps):
        state.step_index = step
        temb = torch.full((1, 4), float(step + 1))  # each step's blocks add 2 x (step + 1)
        out = stepcache.cached_blocks(method, [Add(), Add()], stepcache.Batch(h, enc, temb, 1, [state]))
        if state.cache.reused > len(reused):
            reused.append(step)
            torch.testing.assert_close(out, torch.full_like(out, 2.0 * (last_computed + 1)))
        else:
            last_computed = step
            torch.testing.assert_close(out, torch.full_like(out, 2.0 * (step + 1)))
    return reused


def test_the_rule():
    # Ratio 1.02 every step, threshold 0.1: errors 0.02, 0.0604, 0.1216 (computes, resets), ...; the first
    # round(0.2 x 10) = 2 steps compute; the last computes.
    ratios = {"ratios": [1.02] * 10}
    assert decisions(ratios) == [2, 3, 5, 6, 8]
    assert decisions(ratios | {"max_skip": 1}) == [2, 4, 6, 8]
    assert decisions(ratios | {"retention": 0.5}) == [5, 6, 8]
    assert decisions({"ratios": [1.0]}) == [2, 3, 4, 6, 7, 8]  # error 0: max_skip (3) reused, then one computed
    assert decisions({"ratios": [1.5]}) == []  # every step's error above the threshold
    assert decisions(ratios, threshold=0.0) == []


def test_ratios_follow_the_schedule():
    method = stepcore.method_of("magcache", {"ratios": [1.0, 2.0, 3.0]}, 2)
    # (halves round to even, as torch.round in diffusers' nearest_interp)
    assert [stepcache.magnitude_ratio(method, s, 5) for s in range(5)] == [1.0, 1.0, 2.0, 3.0, 3.0]
    assert [stepcache.magnitude_ratio(method, s, 3) for s in range(3)] == [1.0, 2.0, 3.0]


def test_settings_and_refusals(tiny_sd3, tiny_flux):
    assert cache_settings("magcache", '{"max_skip": 2, "retention": 0.1, "ratios": [1, 1.1]}')["retention"] == 0.1
    for text, message in [
        ('{"max_skip": 0}', "max_skip must be an integer >= 1"),
        ('{"retention": 1.5}', "retention must be a number from 0 to 1"),
        ('{"ratios": []}', "ratios must be a non-empty list of positive numbers"),
        ('{"ratios": [1, -1]}', "ratios must be a non-empty list of positive numbers"),
        ('{"fn": 1}', "'fn' unknown to --cache magcache"),
    ]:
        with pytest.raises(ConfigError, match=message):
            cache_settings("magcache", text)
    with pytest.raises(ValueError, match="needs the checkpoint's magnitude ratios: measure them"):
        load_adapter(tiny_sd3).enable_step_cache("magcache", 0.1)
    flux = load_adapter(tiny_flux)
    flux.enable_step_cache("magcache", 0.1)  # FLUX.1's published ratios
    assert len(flux.cache.method.ratios) == 28 and flux.cache.method.ratios[1] == pytest.approx(1.21094)


def test_calibration_measures_the_checkpoint(tmp_path, tiny_sd3):
    """`python -m diffusiond.tools.calibrate --method magcache`: a ratio per step beside the weights (a TeaCache fit
    already there is kept), which `--cache magcache` then uses."""
    from diffusiond.tools import calibrate

    assert calibrate.magnitude_ratios([(1, 2.0), (1, 4.0), (2, 0.5)]) == [1.0, 3.0, 0.5]
    model = shutil.copytree(tiny_sd3, tmp_path / "model")
    (model / settings.CACHE_FILE).write_text(json.dumps({"teacache": {"coefficients": [1.0, 0.0]}}))
    argv = ["--model", str(model), "--steps", "5", "--size", "64x64", "--method", "magcache"]
    assert calibrate.main([*argv, "--prompts", str(_prompts(tmp_path))]) == 0
    written = json.loads((model / settings.CACHE_FILE).read_text())
    assert written["teacache"]["coefficients"] == [1.0, 0.0]
    ratios = written["magcache"]["ratios"]
    assert len(ratios) == 5 and ratios[0] == 1.0 and all(r > 0 for r in ratios)
    assert len(set(ratios[1:])) > 1, "every step measured the same: nothing was measured"
    adapter = load_adapter(str(model))
    adapter.enable_step_cache("magcache", 0.1)
    assert adapter.cache.method.ratios == tuple(ratios)


def _prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red circle\na blue square\na cat\n")
    return path
