"""TaylorSeer on DBCache, per request (models/stepcache/methods.py `_forecast`, issue 35): a reusing request adds the
Taylor forecast of the reused span's residuals from its own last computed steps instead of the last residuals.

- The forecast itself, on blocks whose residual follows the step exactly (linear, quadratic): order 1 extrapolates a
  linear residual exactly; order 2 adds half the second difference; without TaylorSeer the step reuses the last one.
- On the deeper tiny SD3 and FLUX.1 checkpoints (tests/models/test_dbcache.py): threshold 0 equals the uncached image;
  a batch mixing thresholds and step counts gives each request its image alone (a forecast that read another
  request's rows, or differences kept for the batch, changes them), and the forecast changes what reuse gives.
"""

from __future__ import annotations

import asyncio
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

CONFIG = {"fn": 2, "bn": 1, "warmup": 2, "taylorseer": True, "taylorseer_order": 2}


class Ramp(torch.nn.Module):
    """A block whose image residual is `k` times the mean of `temb` (the step's value, below): it does not depend on
    the image input, so a forecast can be compared with the computed residual exactly."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, hidden_states, encoder_hidden_states, temb, **_):
        return encoder_hidden_states, hidden_states + self.k * temb.mean(dim=1)[:, None, None]


def _outputs(config: dict, curve, steps: int, threshold: float) -> list[torch.Tensor]:
    """The blocks' output at each step of one request whose residuals follow `curve(step)`."""
    blocks = [Ramp(1.0), Ramp(2.0), Ramp(3.0)]
    method = stepcore.method_of("dbcache", config, len(blocks))
    torch.manual_seed(0)
    h, enc = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    state = SimpleNamespace(
        request_id="a",
        params=SimpleNamespace(cache_threshold=threshold, cache_steps=None),
        step_index=0,
        total_steps=steps,
        cache=None,
    )
    outs = []
    for step in range(steps):
        state.step_index = step
        temb = torch.full((2, 4), float(curve(step)))
        outs.append(stepcache.cached_blocks(method, blocks, stepcache.Batch(h, enc, temb, 2, [state])))
    return outs


@pytest.mark.parametrize(
    ("order", "curve", "expected"),
    [
        (1, lambda s: 1 + s, lambda s: 1 + s),  # linear: order 1 is exact
        # quadratic (1 + s)^2, from steps 0-2 (1, 4, 9): 9 + 5 + (5 - 3) / 2 = 15 at step 3 (not 16: Taylor, not
        # Newton's formula)
        (2, lambda s: (1 + s) ** 2, lambda s: 15.0),
    ],
)
def test_the_forecast_extrapolates_the_span(order, curve, expected):
    config = {"fn": 1, "warmup": 3, "taylorseer": True, "taylorseer_order": order}
    exact = _outputs(config, curve, 5, threshold=0.0)
    forecast = _outputs(config, curve, 5, threshold=100.0)
    plain = _outputs({"fn": 1, "warmup": 3}, curve, 5, threshold=100.0)
    # Step 3 reuses (the warm-up computed 0-2); the middle and last blocks (k 2 + 3 = 5) add 5 x the curve.
    step = 3
    residual = (forecast[step] - exact[step]) / 5  # the forecast's error, per unit of the curve
    torch.testing.assert_close(residual, torch.full_like(residual, expected(step) - curve(step)))
    torch.testing.assert_close(plain[step] - exact[step], torch.full_like(residual, 5 * (curve(2) - curve(step))))
    for s in range(3):
        torch.testing.assert_close(forecast[s], exact[s])


@pytest.fixture(scope="module", params=["sd3", "flux"])
def deep(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_deep")


@pytest.fixture(scope="module")
def seer(deep):
    adapter = load_adapter(deep)
    adapter.enable_step_cache("dbcache", 0.0, CONFIG)
    assert adapter.cache.method.taylorseer and adapter.cache.method.taylorseer_order == 2
    return adapter


def test_threshold_zero_is_exact(deep, seer):
    requests = [params(1), params(2, steps=5)]
    exact = asyncio.run(run(load_adapter(deep), requests, together=True))
    zero = asyncio.run(run(seer, requests, together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_each_request_forecasts_from_its_own_steps(deep, seer, monkeypatch):
    reused = count_reuse(monkeypatch)
    mix = [params(1, threshold=0.0), params(2, threshold=10.0), params(3, threshold=0.5), params(4, steps=5)]
    together = asyncio.run(run(seer, mix, together=True))
    assert sum(reused) > 0, "nothing was reused: the test would not show anything"
    alone = asyncio.run(run(seer, mix, together=False))
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"request {i}: the batch changed its image")
    plain = load_adapter(deep)
    plain.enable_step_cache("dbcache", 0.0, {k: v for k, v in CONFIG.items() if not k.startswith("taylorseer")})
    reused = asyncio.run(run(plain, [params(2, threshold=10.0)], together=False))
    assert np.abs(reused[0] - together[1]).max() > 1e-3, "the forecast gave what plain reuse gives"


def test_settings_are_checked():
    assert cache_settings("dbcache", '{"taylorseer": true, "taylorseer_order": 2}') == {
        "taylorseer": True,
        "taylorseer_order": 2,
    }
    for text, message in [
        ('{"taylorseer": 1}', "taylorseer must be true or false"),
        ('{"taylorseer": true, "taylorseer_order": 3}', "taylorseer_order must be an integer from 1 to 2"),
        ('{"taylorseer_order": 2}', "TaylorSeer is off"),
    ]:
        with pytest.raises(ConfigError, match=message):
            cache_settings("dbcache", text)
    with pytest.raises(ConfigError, match="'taylorseer' unknown to --cache fbcache"):
        cache_settings("fbcache", '{"taylorseer": true}')
