"""Encoded prompts are cached by text, bounded in bytes; a cached prompt gives the image an uncached one gives."""

import numpy as np
import pytest
import torch
from engines import guidance

from diffusiond.models.flowmatch.prompts import PromptCache
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams


def test_lru_bounded_in_bytes():
    cache = PromptCache(budget_bytes=3 * 400)  # three entries of 100 float32
    calls: list[list[str]] = []

    def encode(texts):
        calls.append(list(texts))
        return [(torch.full((1, 100), float(len(t))),) for t in texts]

    cache.lookup(["a", "bb", "a"], encode)
    cache.lookup(["a", "ccc"], encode)
    assert calls == [["a", "bb"], ["ccc"]] and (cache.hits, cache.misses) == (1, 3)
    cache.lookup(["dddd"], encode)  # over budget: the least recently used ("bb") goes
    cache.lookup(["bb", "a"], encode)
    assert calls[-1] == ["bb"] and cache.bytes <= cache.budget


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_a_cached_prompt_gives_the_same_image(family, request):
    adapter = load_adapter(request.getfixturevalue(f"tiny_{family}"))
    params = adapter.resolve(
        SamplingParams(
            prompt="a red circle",
            negative_prompt="blurry",
            seed=3,
            width=64,
            height=64,
            num_inference_steps=3,
            **guidance(adapter, 3.0),
        )
    )

    def run() -> np.ndarray:
        (state,) = adapter.prepare([("r", params)])
        while not state.finished:
            adapter.step([state], adapter.denoise([state]))
        return adapter.decode([state])[0]

    first = run()
    misses = adapter.prompts.cache.misses
    second = run()
    assert adapter.prompts.cache.misses == misses and adapter.prompts.cache.hits >= 2  # both texts came from the cache
    np.testing.assert_array_equal(first, second)
