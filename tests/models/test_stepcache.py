"""Step caching decided per request inside a batch (models/stepcache.py), on the tiny SD3 and FLUX checkpoints.

- Threshold 0 is exact: the cached forward (first block, then the rest) gives the uncached engine's image, which
  tests/models/test_parity.py holds to diffusers' own pipeline.
- A batch that mixes exact and cached requests, different thresholds and different step counts gives every request
  the image it gets alone with the same settings, and the cached ones really skip blocks. A batch-wide decision
  (one `reuse` for every request) fails this: the exact request would be cached too.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.engine.request import SamplingParams
from diffusiond.models import stepcache
from diffusiond.models.base import ParamError
from diffusiond.models.loader import load_adapter

# Batched rows may differ from a row computed alone in the last bits (matmul blocking); as tests/engine/test_batching.
ATOL = 1e-5


@pytest.fixture(scope="module", params=["sd3", "flux"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def plain(family, request):
    return load_adapter(request.getfixturevalue(f"tiny_{family}"))


@pytest.fixture(scope="module")
def cached(family, request):
    adapter = load_adapter(request.getfixturevalue(f"tiny_{family}"))
    adapter.enable_step_cache("fbcache", 0.0)
    return adapter


def params(seed: int, steps: int = 8, threshold: float | None = None) -> SamplingParams:
    return SamplingParams(
        prompt=f"a shape {seed}",
        seed=seed,
        width=64,
        height=64,
        num_inference_steps=steps,
        guidance_scale=4.0,
        cache_threshold=threshold,
    )


async def run(adapter, requests: list[SamplingParams], together: bool) -> list[np.ndarray]:
    engine = Engine(adapter, max_batch=8, batch_wait=0.5 if together else 0.0)
    await engine.start()
    try:
        if together:
            results = await asyncio.gather(*(engine.add_request(p).result() for p in requests))
        else:
            results = [await engine.add_request(p).result() for p in requests]
    finally:
        await engine.stop()
    assert all(isinstance(r, Completed) for r in results), results
    return [r.image for r in results]


def test_threshold_zero_is_exact(plain, cached):
    requests = [params(1), params(2, steps=5)]
    exact = asyncio.run(run(plain, requests, together=True))
    zero = asyncio.run(run(cached, requests, together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_each_request_decides_alone(cached, plain, monkeypatch):
    reused: list[int] = []
    original = stepcache.reuse

    def counting(state, change):
        decision = original(state, change)
        reused.append(int(decision))
        return decision

    monkeypatch.setattr(stepcache, "reuse", counting)
    # An exact request, two cached at different thresholds, one with fewer steps.
    mix = [params(1, threshold=0.0), params(2, threshold=10.0), params(3, threshold=0.5), params(4, steps=5)]
    together = asyncio.run(run(cached, mix, together=True))
    assert sum(reused) > 0, "nothing was reused: the test would not show anything"
    alone = asyncio.run(run(cached, mix, together=False))
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"request {i}: the batch changed its image")
    # The exact one is the uncached image; the aggressively cached one is not (blocks were skipped).
    exact = asyncio.run(run(plain, [params(1), params(2)], together=False))
    np.testing.assert_allclose(together[0], exact[0], atol=ATOL)
    assert np.abs(together[1] - exact[1]).max() > 1e-3


def test_a_batch_wide_decision_would_fail(cached, monkeypatch):
    """Break the feature on purpose: one decision for the batch (the first request's). The mixed batch then no
    longer reproduces the images its requests get alone."""
    original = stepcache.reuse
    decided: dict[int, bool] = {}

    def batch_wide(state, change):
        step = state.step_index
        if step not in decided:
            decided[step] = original(state, change)
        return decided[step] and change is not None

    mix = [params(2, threshold=10.0), params(1, threshold=0.0)]
    alone = asyncio.run(run(cached, mix, together=False))
    monkeypatch.setattr(stepcache, "reuse", batch_wide)
    together = asyncio.run(run(cached, mix, together=True))
    assert np.abs(together[1] - alone[1]).max() > 1e-3, "a batch-wide decision went unnoticed"


def test_refusals(plain):
    with pytest.raises(ParamError, match="without step caching"):
        plain.resolve(params(1, threshold=0.2))
    assert plain.resolve(params(1, threshold=0.0)).cache_threshold == 0.0
    with pytest.raises(ValueError, match="unknown cache method"):
        plain.enable_step_cache("teacache", 0.1)


@pytest.mark.asyncio
async def test_over_http_per_request_thresholds(serve):
    import aiohttp

    from diffusiond.bench.serve import sse_events

    cached_server = serve(cache="fbcache", cache_threshold=0.0)
    plain_server = serve()
    body = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 6, "cache_threshold": 10.0}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cached_server.base_url}/v1/generations", json=body) as resp:
            names = [name async for name, _ in sse_events(resp)]
        assert names[-1] == "completed", names
        async with session.post(f"{plain_server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "cache_threshold"
        body["cache_threshold"] = -1
        async with session.post(f"{cached_server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "cache_threshold"
