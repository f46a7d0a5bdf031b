"""Ovis-Image's, LongCat-Image's, LongCat-Image-Edit's and GLM-Image's step caches (models/stepcache/forwards.py
`ovis_forward`, `longcat_forward`; the edit's image tokens run through the blocks with the rest; GLM-Image's
`cached_forward`, its rows deciding apart: a quoting prompt's positive row runs in a call of its own glyph length) on
deeper tiny checkpoints (2 double- and 3 single-stream blocks, so that DBCache's middle crosses from one kind to the
other), saved and loaded through `from_pretrained`; LongCat-Image's call switches (`arguments`). The families' parity
with their pipelines is tests/models/test_parity.py's; their batching tests/engine/test_batching.py's; CFG-parallel
tests/engine/test_spmd.py's; over HTTP tests/daemon/test_family_streams.py's.

- Threshold 0 equals the uncached engine's images, for each method the families declare.
- A batch mixing an exact request and a cached one: the exact one gets the uncached image while the cached one really
  reuses (a cache that never skips, or one batch-wide decision, fails here).
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from caching import ATOL, count_reuse, run, run_batch
from caching import params as shared_params
from pictures import picture

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.tiny.glm_image import build_glm_image
from diffusiond.models.tiny.longcat import build_longcat_image, build_longcat_image_edit
from diffusiond.models.tiny.ovis import build_ovis_image

METHODS = {"fbcache": None, "dbcache": {"fn": 1, "bn": 1, "warmup": 2}, "x0cache": None}
BUILDERS = {
    "ovis-image": build_ovis_image,
    "longcat-image": build_longcat_image,
    "longcat-image-edit": build_longcat_image_edit,
    "glm-image": lambda num_layers, num_single_layers: build_glm_image(num_layers=num_layers + num_single_layers),
}


def params(family: str, seed: int, **kwargs) -> SamplingParams:
    """The cache tests' request; an edit family's edits an image (its tokens run through the cache with the rest)."""
    sent = shared_params(seed, **kwargs)
    if family == "glm-image" and seed % 2:  # quoted text: its positive row in a call apart from the negatives
        return msgspec.structs.replace(sent, prompt=f"{sent.prompt} saying 'hi'")
    return msgspec.structs.replace(sent, image=picture(64, 64, seed=seed)) if family.endswith("-edit") else sent


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def deep(request, tmp_path_factory) -> tuple[str, str]:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = BUILDERS[request.param](num_layers=2, num_single_layers=3)
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}-deep"
    pipe.save_pretrained(path)
    return request.param, str(path)


@pytest.fixture(scope="module")
def exact(deep) -> list[np.ndarray]:
    family, path = deep
    return asyncio.run(run(load_adapter(path), [params(family, 1), params(family, 2, steps=5)], together=True))


@pytest.mark.parametrize("method", list(METHODS))
def test_threshold_zero_is_exact_and_a_batch_decides_per_request(method, deep, exact, monkeypatch):
    family, path = deep
    adapter = load_adapter(path)
    assert adapter.family == family and method in adapter.capabilities.cache_methods
    adapter.enable_step_cache(method, 0.0, METHODS[method])
    zero = asyncio.run(run(adapter, [params(family, 1), params(family, 2, steps=5)], together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    reused = count_reuse(monkeypatch)
    mixed = asyncio.run(
        run(adapter, [params(family, 1, threshold=0.0), params(family, 3, threshold=10.0)], together=True)
    )
    np.testing.assert_allclose(mixed[0], exact[0], atol=ATOL)  # the exact request, beside a cached one
    assert sum(reused) > 0, "the cached request never reused"
    assert float(np.abs(mixed[1] - exact[0]).max()) > 100 * ATOL


def test_glm_image_rows_each_reuse_from_their_own_cache(tiny_glm_image, monkeypatch):
    """A GLM-Image request that quotes text runs its positive row in a call of that glyph length and its negative row
    in the empty prompt's: at threshold 10 each row reuses from its own cache (one cache per request: red)."""
    adapter = load_adapter(tiny_glm_image)
    adapter.enable_step_cache("fbcache", 0.0)
    reused = count_reuse(monkeypatch)
    kept: list = []
    request = SamplingParams(
        prompt="a sign saying 'hi'", seed=1, width=64, height=64, num_inference_steps=6, cache_threshold=10.0
    )
    run_batch(adapter, [request], kept)
    (state,) = kept
    assert sum(reused) > 0 and set(state.row_caches) == {1}, state.row_caches
    assert state.cache.reused > 0 and state.row_caches[1].reused > 0


def test_longcat_takes_its_call_switches_by_name_and_ovis_none(tiny_longcat, tiny_ovis):
    longcat, ovis = load_adapter(tiny_longcat), load_adapter(tiny_ovis)
    base = SamplingParams(prompt="a cat", width=64, height=64)
    assert longcat.resolve(base).arguments == {
        "enable_prompt_rewrite": True,
        "enable_cfg_renorm": True,
        "cfg_renorm_min": 0.0,
    }  # the call's defaults
    mine = longcat.resolve(msgspec.structs.replace(base, arguments={"cfg_renorm_min": 1, "enable_cfg_renorm": False}))
    assert mine.arguments == {"enable_prompt_rewrite": True, "enable_cfg_renorm": False, "cfg_renorm_min": 1.0}
    refused = [
        {"enable_prompt_rewrite": 1},
        {"cfg_renorm_min": 1.5},
        {"cfg_renorm_min": True},
        {"max_new_tokens": 4},
    ]
    for arguments in refused:
        with pytest.raises(ParamError) as caught:
            longcat.resolve(msgspec.structs.replace(base, arguments=arguments))
        assert caught.value.param == "arguments", arguments
    with pytest.raises(ParamError, match="dedicated adapter"):
        ovis.resolve(msgspec.structs.replace(base, arguments={"enable_prompt_rewrite": False}))
