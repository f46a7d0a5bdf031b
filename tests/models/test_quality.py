"""Per-request quality presets (issue 52, item 4; models/stepcache/settings.py `quality_level`): a request's `quality`
picks how much speed it trades for agreement with its exact image, as a multiple of the server's step-cache
threshold ("lossless" 0, "high" a quarter, "balanced" the server's, "fast" twice), mixed freely inside one batch
(each request decides with its own threshold: models/stepcache/methods.py). OpenAI's words map onto them and an
unknown word is mapped, not refused. Where no step cache runs, every preset is the exact image (and says so)."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import numpy as np
import pytest
from caching import ATOL, params, run

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.stepcache import methods as stepcache
from diffusiond.models.stepcache.settings import quality_level


@pytest.mark.parametrize(
    ("word", "preset"),
    [
        ("lossless", "lossless"),
        ("high", "high"),
        ("balanced", "balanced"),
        ("fast", "fast"),
        ("auto", "balanced"),
        ("medium", "balanced"),
        ("standard", "balanced"),
        ("low", "fast"),
        ("hd", "high"),
        ("xhigh", "lossless"),
        ("Ultra", "lossless"),
        ("ultra-low", "fast"),
        ("draft", "fast"),
        ("something-new", "balanced"),
    ],
)
def test_words_map_to_presets(word, preset):
    assert quality_level(word) == preset


def quality(seed: int, word: str | None, **extra):
    return msgspec.structs.replace(params(seed, steps=8), quality=word, **extra)


def test_presets_resolve_to_thresholds(tiny_sd3):
    cached = load_adapter(tiny_sd3)
    cached.enable_step_cache("fbcache", 1.0)
    resolved = {w: cached.resolve(quality(1, w)) for w in ("lossless", "high", "balanced", "fast", "low", "xhigh")}
    assert {w: r.cache_threshold for w, r in resolved.items()} == {
        "lossless": 0.0, "high": 0.25, "balanced": 1.0, "fast": 2.0, "low": 2.0, "xhigh": 0.0,
    }  # fmt: skip
    assert resolved["low"].quality == "fast" and resolved["xhigh"].quality == "lossless"
    # A threshold sent with it wins (no preset applied); without a step cache every preset is exact.
    both = cached.resolve(quality(1, "fast", cache_threshold=0.5))
    assert both.cache_threshold == 0.5 and both.quality is None
    plain = load_adapter(tiny_sd3).resolve(quality(1, "fast"))
    assert plain.cache_threshold == 0.0 and plain.quality == "lossless"


def test_presets_mix_in_one_batch(tiny_sd3, monkeypatch):
    """Four presets in one batch: each request's image is the one it gets alone, the lossless one is the exact
    image, and the share of steps each reuses follows its preset. A preset ignored (every request at the server's
    threshold) fails here: the lossless one would reuse."""
    cached = load_adapter(tiny_sd3)
    cached.enable_step_cache("fbcache", 1.0)
    words = ["lossless", "high", "balanced", "fast"]
    requests = [quality(i + 1, w) for i, w in enumerate(words)]
    reused: dict[int, int] = dict.fromkeys(range(1, 5), 0)
    original = stepcache.reuse

    def counting(state, change):
        decision = original(state, change)
        reused[state.params.seed] += int(decision)
        return decision

    monkeypatch.setattr(stepcache, "reuse", counting)
    together = asyncio.run(run(cached, requests, together=True))
    counts = [reused[i] for i in range(1, 5)]
    assert counts[0] == 0 and counts[3] > 0 and counts == sorted(counts), counts
    alone = asyncio.run(run(cached, requests, together=False))
    for word, a, b in zip(words, together, alone, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"{word}: the batch changed its image")
    (exact,) = asyncio.run(run(load_adapter(tiny_sd3), [params(1, steps=8)], together=False))
    np.testing.assert_allclose(together[0], exact, atol=ATOL)


@pytest.mark.asyncio
async def test_openai_quality_is_mapped_and_echoed_only_where_honoured(serve):
    """OpenAI's `quality`: any word is taken (an unknown one mapped, not refused); the answer echoes low, medium or
    high only where a step cache ran that preset."""
    body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2}
    async with aiohttp.ClientSession() as session:
        for server, echoed in ((serve(cache="fbcache"), True), (serve(), False)):
            url = f"{server.base_url}/v1/images/generations"
            for word in ("high", "xhigh", "low"):
                async with session.post(url, json={**body, "quality": word}) as r:
                    assert r.status == 200, await r.text()
                    answer = await r.json()
                expected = word if echoed and word != "xhigh" else None
                assert answer.get("quality") == expected, (word, answer.get("quality"))
