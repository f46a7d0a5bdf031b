"""Step caching decided per request inside a batch (models/stepcache/methods.py), on the tiny SD3 and FLUX checkpoints,
for both methods (first-block cache and TeaCache).

- Threshold 0 is exact: the cached forward (first block, then the rest) gives the uncached engine's image, which
  tests/models/test_parity.py holds to diffusers' own pipeline.
- A batch that mixes exact and cached requests, different thresholds and different step counts gives every request
  the image it gets alone with the same settings, and the cached ones really skip blocks. A batch-wide decision
  (one `reuse` for every request) fails this: the exact request would be cached too.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from caching import ATOL, count_reuse, params, run, run_joining

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError
from diffusiond.models.stepcache import methods as stepcache
from diffusiond.models.stepcache import settings

FIXTURES = {
    "sd3": "tiny_sd3",
    "flux": "tiny_flux",
    "qwen-image": "tiny_qwenimage",
    "z-image": "tiny_zimage",
    "flux2-klein": "tiny_flux2klein",
    "flux2": "tiny_flux2",
}


@pytest.fixture(scope="module", params=list(FIXTURES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def plain(family, request):
    return load_adapter(request.getfixturevalue(FIXTURES[family]))


@pytest.fixture(scope="module", params=["fbcache", "teacache", "x0cache", "magcache"])
def method(request):
    return request.param


# MagCache's ratios (the tiny checkpoints have no calibration; tests/models/test_magcache.py measures one).
CONFIGS = {"magcache": {"ratios": [1.0, 1.02, 0.98, 1.0]}}


@pytest.fixture(scope="module")
def cached(family, method, request):
    adapter = load_adapter(request.getfixturevalue(FIXTURES[family]))
    adapter.enable_step_cache(method, 0.0, CONFIGS.get(method))
    return adapter


def test_threshold_zero_is_exact(plain, cached):
    requests = [params(1), params(2, steps=5)]
    exact = asyncio.run(run(plain, requests, together=True))
    zero = asyncio.run(run(cached, requests, together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_each_request_decides_alone(cached, plain, monkeypatch):
    reused = count_reuse(monkeypatch)
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


def test_a_request_measures_its_change_as_alone(cached, monkeypatch):
    """The signal each decision reads is the request's own: in a batch whose rows are padded to the longest text
    (Qwen-Image's texts, Z-Image's joint sequence), a request's measured change equals the one it measures alone.
    (A signal that read the padding's tokens fails here.)"""
    seen: dict[tuple[int, int], float] = {}
    original = stepcache.reuse

    def recording(state, change):
        if change is not None:
            seen[(state.params.seed, state.step_index)] = change
        return original(state, change)

    monkeypatch.setattr(stepcache, "reuse", recording)
    # Prompts of two lengths (Z-Image pads a caption to a multiple of 32 tokens: one past 32); nothing reused.
    long = msgspec.structs.replace(params(2, threshold=0.0), prompt="a shape on a blue background, " * 8)
    mix = [params(1, threshold=0.0), long]
    asyncio.run(run(cached, mix, together=True))
    together, seen = seen, {}
    asyncio.run(run(cached, mix, together=False))
    assert together.keys() == seen.keys()
    assert together or cached.cache.name == "magcache", "no change was measured: the test would not show anything"
    for key, change in seen.items():
        assert together[key] == pytest.approx(change, rel=1e-3, abs=1e-6), key


@pytest.mark.parametrize("family", ["qwen-image", "z-image"])
def test_a_request_keeps_its_cache_when_the_batch_pads_to_another_length(family, request, monkeypatch):
    """A request reusing DBCache's span (with the text tokens' residual kept: bn=1; TaylorSeer's differences) whose
    batch is joined by a request with a longer text: its rows are padded to another length from then on, and what
    it keeps is fitted to it (before: a shape error at the join). Each gets the image it gets alone."""
    adapter = load_adapter(request.getfixturevalue(FIXTURES[family].replace("-", "") + "_deep"))
    adapter.enable_step_cache("dbcache", 0.0, {"fn": 1, "bn": 1, "taylorseer": True, "taylorseer_order": 2})
    reused = count_reuse(monkeypatch)
    first = params(1, steps=12, threshold=10.0)
    later = msgspec.structs.replace(params(2, steps=8, threshold=10.0), prompt="a shape on a blue background, " * 8)
    joined = asyncio.run(run_joining(adapter, first, later, after=4))
    assert sum(reused) > 0
    alone = asyncio.run(run(adapter, [first, later], together=False))
    for i, (a, b) in enumerate(zip(joined, alone, strict=True)):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"request {i}: the join changed its image")


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
        plain.enable_step_cache("seacache", 0.1)


def test_teacache_skips_every_block_and_accumulates(family, request, monkeypatch):
    """TeaCache decides before any block runs: a request that reuses runs no block at all at that step (fbcache
    always runs the first), so a TeaCache that ran the first block (or every block) for it would fail here. Its
    estimate is the rescaled input change summed over the steps since its last computed one, reset when it computes."""
    adapter = load_adapter(request.getfixturevalue(FIXTURES[family]))
    adapter.enable_step_cache("teacache", 0.0)
    t = adapter.transformer
    first_block = (t.layers if family == "z-image" else t.transformer_blocks)[0]
    rows_through: list[int] = []  # rows through the first block, per forward
    first_block.register_forward_hook(
        lambda m, a, k, out: rows_through.append((out[1] if isinstance(out, tuple) else out).shape[0]),
        with_kwargs=True,
    )
    raw: list[float | None] = []  # each request's measured input change, in the order `reuse` sees them
    seen: list[tuple[str, float | None, bool]] = []
    original_changes, original_reuse = stepcache.changes, stepcache.reuse

    def recording_changes(*args):
        values = original_changes(*args)
        raw.extend(values)
        return values

    def recording_reuse(state, change):
        seen.append((state.request_id, change, original_reuse(state, change)))
        return seen[-1][2]

    monkeypatch.setattr(stepcache, "changes", recording_changes)
    monkeypatch.setattr(stepcache, "reuse", recording_reuse)
    asyncio.run(run(adapter, [params(1, steps=8, threshold=10.0), params(2, steps=8, threshold=0.0)], together=True))
    reused = sum(decision for *_, decision in seen)
    assert reused > 0
    # 8 forwards of 2 requests (SD3 runs CFG: 2 rows each; FLUX and Qwen-Image without a negative prompt: 1;
    # Qwen-Image's prompts differ in length, so its text mask is sub-batched with the rows). Each reused
    # request-step takes its rows out of the first block too.
    rows = 2 if family in ("sd3", "z-image", "flux2-klein") else 1  # CFG by default
    assert len(rows_through) == 8 and sum(rows_through) == rows * (2 * 8 - reused), (rows_through, reused)
    accumulated: dict[str, float] = {}
    for change, (request_id, estimate, decision) in zip(raw, seen, strict=True):
        if change is None:
            assert estimate is None
            continue
        expected = accumulated.get(request_id, 0.0) + adapter.cache.method.rescale(change)
        assert estimate == pytest.approx(expected, rel=1e-12)
        accumulated[request_id] = expected if decision else 0.0


def test_calibration_fits_the_checkpoint(tmp_path, request):
    """`python -m diffusiond.tools.calibrate`: every request-step after the first gives a pair; the fit goes beside the
    weights and a server with --cache teacache uses it instead of the family's default. The fit recovers a known
    polynomial."""
    import json
    import shutil

    from diffusiond.tools import calibrate

    x = np.linspace(0.01, 0.5, 40)
    known = (3.0, -2.0, 0.5, 0.1)
    coefficients, r2 = calibrate.fit(list(zip(x, np.polyval(known, x), strict=True)), 3)
    np.testing.assert_allclose(coefficients, known, atol=1e-6)
    assert r2 == pytest.approx(1.0)

    model = shutil.copytree(request.getfixturevalue("tiny_sd3"), tmp_path / "model")
    pairs = calibrate.record_pairs(str(model), ["a red circle", "a blue square", "a cat"], steps=5, size=(64, 64))
    assert len(pairs) == 3 * 4, "one pair per request-step after the first"
    assert all(a > 0 and b > 0 for a, b in pairs)
    assert calibrate.main(["--model", str(model), "--steps", "5", "--size", "64x64", "--degree", "2"]) == 0
    fitted = json.loads((model / settings.CACHE_FILE).read_text())["teacache"]
    assert fitted["pairs"] == 16 * 4 and len(fitted["coefficients"]) == 3
    adapter = load_adapter(str(model))
    adapter.enable_step_cache("teacache", 0.1)
    assert adapter.cache.method.coefficients == tuple(fitted["coefficients"])
    assert load_adapter(request.getfixturevalue("tiny_flux")).cache.teacache == settings.FLUX_TEACACHE


@pytest.mark.asyncio
async def test_over_http_per_request_thresholds(serve, tiny_sd3_deep):
    import aiohttp

    from diffusiond.bench.serve import sse_events

    cached_servers = [serve(cache=method, cache_threshold=0.0) for method in ("fbcache", "teacache", "x0cache")]
    # DBCache as docs/acceleration.md starts it, on a checkpoint with blocks left between the first and the last.
    dbcache = '{"fn": 1, "bn": 1, "warmup": 2}'
    cached_servers.append(serve(model=tiny_sd3_deep, cache="dbcache", cache_config=dbcache, cache_threshold=0.0))
    # MagCache with its ratios given (docs' command reads them from a calibration, tests/models/test_magcache.py).
    cached_servers.append(serve(cache="magcache", cache_config='{"ratios": [1.0, 1.01]}', cache_threshold=0.0))
    cached_server = cached_servers[0]
    plain_server = serve()
    body = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 6, "cache_threshold": 10.0}
    async with aiohttp.ClientSession() as session:
        for server in cached_servers:
            async with session.post(f"{server.base_url}/v1/generations", json=body) as resp:
                names = [name async for name, _ in sse_events(resp)]
            assert names[-1] == "completed", names
        async with session.post(f"{plain_server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "cache_threshold"
        body["cache_threshold"] = -1
        async with session.post(f"{cached_server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "cache_threshold"
        # SCM step masks per request (tests/models/test_scm.py): a preset or step indices; refused where they cannot be.
        del body["cache_threshold"]  # (the server's: a mask alone is refused by a server without a cache)
        for steps in ("fast", [0, 2, 4]):
            async with session.post(
                f"{cached_server.base_url}/v1/generations", json=body | {"cache_steps": steps}
            ) as resp:
                names = [name async for name, _ in sse_events(resp)]
            assert names[-1] == "completed", (steps, names)
        for server, steps in [
            (cached_server, [0, 6]),
            (cached_server, "quick"),
            (cached_server, [-1]),
            (plain_server, "fast"),
        ]:
            async with session.post(f"{server.base_url}/v1/generations", json=body | {"cache_steps": steps}) as resp:
                assert resp.status == 400, steps
                assert (await resp.json())["error"]["param"] == "cache_steps", steps
