"""Stable Audio Open (`StableAudioPipeline`) as a dedicated family (models/families/stable_audio.py): sound alone,
step-batched, each request's waveform equal to the pipeline's own `__call__` (float32 on CPU: max abs diff <= 1e-4).
Its scheduler is an SDE solver (cosine DPM-Solver): each request keeps its own Brownian tree, seeded by its seed as
the call seeds it from the generator. Its step caches (TeaCache, fbcache, DBCache: models/stepcache/forwards.py
`stable_audio_forward`) at threshold 0 are the uncached sound, and decide per request in a mixed batch. Over HTTP:
tests/daemon/test_stable_audio.py; two ranks: tests/engine/test_spmd.py."""

from __future__ import annotations

import asyncio

import diffusers
import msgspec
import numpy as np
import pytest
import torch
from caching import count_reuse
from engines import run_staggered

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed, Preview
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.tiny.audio import AUDIO_CHANNELS, AUDIO_SAMPLE_RATE

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pipe(tiny_stable_audio):
    pipe = diffusers.StableAudioPipeline.from_pretrained(tiny_stable_audio)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def adapter(tiny_stable_audio):
    return load_adapter(tiny_stable_audio)


def reference(pipe, p: SamplingParams) -> np.ndarray:
    return pipe(
        p.prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale, generator=torch.Generator().manual_seed(p.seed), output_type="np",
        **p.arguments,
    ).audios[0]  # fmt: skip


REQUESTS = [
    SamplingParams(prompt="a dog barking", seed=1, num_inference_steps=6),
    SamplingParams(prompt="a piano note", seed=2, num_inference_steps=5, negative_prompt="noise"),
    SamplingParams(prompt="rain on a roof", seed=3, num_inference_steps=6, arguments={"audio_end_in_s": 0.5}),
    SamplingParams(
        prompt="a bell", seed=4, num_inference_steps=5, guidance_scale=3.0, preview_every=1,
        arguments={"audio_start_in_s": 0.25, "audio_end_in_s": 0.75},
    ),
    SamplingParams(prompt="wind", seed=5, num_inference_steps=4, guidance_scale=1.0),
]  # fmt: skip


def test_staggered_requests_equal_the_call_and_share_forwards(adapter, pipe):
    """Five staggered requests (prompts, seeds, steps, a negative prompt, start and end seconds, guidance with and
    without CFG), each equal to its own call; the four with CFG share the transformer's forwards."""
    assert adapter.family == "stable-audio"
    caps = adapter.capabilities
    assert (caps.modality, caps.audio_sample_rate, caps.mode) == ("audio", AUDIO_SAMPLE_RATE, "dedicated")
    assert caps.public()["arguments"] == ["audio_start_in_s", "audio_end_in_s"]
    forwards: list[int] = []
    hook = adapter.transformer.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        _, results, _ = asyncio.run(run_staggered(adapter, [adapter.resolve(p) for p in REQUESTS]))
    finally:
        hook.remove()
    for p, result in zip(REQUESTS, results, strict=True):
        assert isinstance(result, Completed), result
        expected = reference(pipe, adapter.resolve(p))
        assert result.image.shape == expected.shape and result.audio.samples.shape == expected.shape
        assert result.audio.sample_rate == AUDIO_SAMPLE_RATE
        diff = float(np.abs(result.audio.samples - expected).max())
        print(f"{p.prompt!r}: {expected.shape}, max abs diff {diff:.2e}")
        assert diff <= TOLERANCE
    assert results[0].audio.samples.shape == (AUDIO_CHANNELS, AUDIO_SAMPLE_RATE)  # the longest clip by default
    assert results[2].audio.samples.shape[1] == AUDIO_SAMPLE_RATE // 2  # cut at its end
    assert results[3].audio.samples.shape[1] == AUDIO_SAMPLE_RATE // 2  # from its start to its end
    alone = sum(p.num_inference_steps for p in REQUESTS)
    print(f"{len(forwards)} forwards for {alone} request steps")
    assert len(forwards) <= alone - 6, "requests of one batch key ran their own forwards"


def test_its_defaults_are_the_call_s_and_bad_lengths_are_refused(adapter):
    resolved = adapter.resolve(SamplingParams(prompt="a dog"))
    assert (resolved.num_inference_steps, resolved.guidance_scale) == (100, 7.0)  # StableAudioPipeline.__call__'s
    assert resolved.arguments == {"audio_start_in_s": 0.0, "audio_end_in_s": 1.0}  # the longest clip: 1 s
    assert (resolved.width, resolved.height) == (None, None)
    refused = {
        "width": {"width": 64},
        "arguments": {"arguments": {"audio_end_in_s": 2.0}},  # longer than the checkpoint makes
    }
    for param, change in refused.items():
        with pytest.raises(ParamError) as caught:
            adapter.resolve(msgspec.structs.replace(SamplingParams(prompt="a dog"), **change))
        assert caught.value.param == param
    for arguments, match in (
        ({"audio_start_in_s": 0.5, "audio_end_in_s": 0.5}, "after"),
        ({"audio_end_in_s": "long"}, "number"),
        ({"num_waveforms_per_prompt": 2}, "takes no argument"),
    ):
        with pytest.raises(ParamError, match=match):
            adapter.resolve(SamplingParams(prompt="a dog", arguments=arguments))


def test_previews_are_pictures_of_the_latent_and_of_the_sound(adapter):
    """Fast previews draw the latent's channels over time; `preview: "vae"` the decoded waveform's envelope."""

    async def run():
        engine = Engine(adapter, max_batch=4)
        await engine.start()
        try:
            seen = {}
            for mode in ("fast", "vae"):
                p = SamplingParams(prompt="a bell", seed=7, num_inference_steps=3, preview_every=1, preview=mode)
                handle = engine.add_request(adapter.resolve(p))
                seen[mode] = [e for e in [e async for e in handle.events()] if isinstance(e, Preview)]
            return seen
        finally:
            await engine.stop()

    seen = asyncio.run(run())
    channels, frames = adapter.transformer.config.in_channels, adapter.transformer.config.sample_size
    assert [e.step for e in seen["fast"]] == [1, 2] and [e.step for e in seen["vae"]] == [1, 2]
    assert seen["fast"][0].image.shape == (channels * 4, frames * 4, 3)
    vae = seen["vae"][-1].image
    assert vae.shape == (AUDIO_CHANNELS * 48, 256, 3) and vae.dtype == np.uint8
    assert 0 < (vae > 0).mean() < 0.9  # a trace, not a blank or a filled picture


def run_together(adapter, requests) -> list[np.ndarray]:
    async def run():
        engine = Engine(adapter, max_batch=4, batch_wait=0.5)
        await engine.start()
        try:
            handles = [engine.add_request(adapter.resolve(p)) for p in requests]
            return [await h.result() for h in handles]
        finally:
            await engine.stop()

    results = asyncio.run(run())
    assert all(isinstance(r, Completed) for r in results), results
    return [r.image for r in results]


CACHED = [
    SamplingParams(prompt="a dog barking", seed=1, num_inference_steps=8),
    SamplingParams(prompt="a piano note", seed=2, num_inference_steps=6),
]
METHODS = {"teacache": None, "fbcache": None, "dbcache": {"fn": 1, "bn": 0, "warmup": 2}}


@pytest.mark.parametrize("method", list(METHODS))
def test_its_step_caches_are_exact_at_zero_and_decide_per_request(method, tiny_stable_audio, monkeypatch):
    exact_adapter = load_adapter(tiny_stable_audio)
    exact = run_together(exact_adapter, CACHED)
    adapter = load_adapter(tiny_stable_audio)
    adapter.enable_step_cache(method, 0.0, METHODS[method])
    zero = run_together(adapter, CACHED)
    for a, b in zip(exact, zero, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    reused = count_reuse(monkeypatch)
    mixed = run_together(
        adapter,
        [
            msgspec.structs.replace(CACHED[0], cache_threshold=0.0),
            msgspec.structs.replace(CACHED[0], seed=3, cache_threshold=10.0),
        ],
    )
    np.testing.assert_allclose(mixed[0], exact[0], atol=1e-5)  # the exact request, beside a cached one
    assert sum(reused) > 0, "the cached request never reused"
