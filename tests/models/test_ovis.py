"""Ovis-Image's step caches (models/stepcache/forwards.py `ovis_forward`), on a deeper tiny checkpoint (2 double- and
3 single-stream blocks, so that DBCache's middle crosses from one kind to the other), saved and loaded through
`from_pretrained`. The family's parity with its pipeline is tests/models/test_parity.py's; its batching
tests/engine/test_batching.py's; CFG-parallel tests/engine/test_spmd.py's; over HTTP tests/daemon/test_ovis.py's.

- Threshold 0 equals the uncached engine's images, for each method the family declares.
- A batch mixing an exact request and a cached one: the exact one gets the uncached image while the cached one really
  reuses (a cache that never skips, or one batch-wide decision, fails here).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from caching import ATOL, count_reuse, params, run

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.tiny.ovis import build_ovis_image

METHODS = {"fbcache": None, "dbcache": {"fn": 1, "bn": 1, "warmup": 2}, "x0cache": None}


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> str:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = build_ovis_image(num_layers=2, num_single_layers=3)
    path = tmp_path_factory.mktemp("tiny") / "ovis-image-deep"
    pipe.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def exact(deep) -> list[np.ndarray]:
    return asyncio.run(run(load_adapter(deep), [params(1), params(2, steps=5)], together=True))


@pytest.mark.parametrize("method", list(METHODS))
def test_threshold_zero_is_exact_and_a_batch_decides_per_request(method, deep, exact, monkeypatch):
    adapter = load_adapter(deep)
    assert adapter.family == "ovis-image" and method in adapter.capabilities.cache_methods
    adapter.enable_step_cache(method, 0.0, METHODS[method])
    zero = asyncio.run(run(adapter, [params(1), params(2, steps=5)], together=True))
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    reused = count_reuse(monkeypatch)
    mixed = asyncio.run(run(adapter, [params(1, threshold=0.0), params(3, threshold=10.0)], together=True))
    np.testing.assert_allclose(mixed[0], exact[0], atol=ATOL)  # the exact request, beside a cached one
    assert sum(reused) > 0, "the cached request never reused"
    assert float(np.abs(mixed[1] - exact[0]).max()) > 100 * ATOL
