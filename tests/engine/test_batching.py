"""Step-level batching does what it claims: requests that share a batch key share one transformer forward.

Equality of images cannot show this (one forward per request gives the same images), so the transformer's calls and
their rows are counted. Replacing the batched `denoise` by one call per request makes this test fail.
"""

import asyncio

import numpy as np
import pytest
from engines import guidance
from pictures import picture

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

STEPS = 3


@pytest.fixture(scope="module")
def adapter(tiny_sd3):
    return load_adapter(tiny_sd3)


def params(
    seed: int, prompt: str = "a red circle", steps: int = STEPS, guidance: float = 5.0, **more
) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=seed, width=64, height=64, num_inference_steps=steps, guidance_scale=guidance, **more
    )


@pytest.mark.asyncio
async def test_requests_of_one_key_share_each_forward(adapter):
    calls: list[int] = []  # rows of each transformer call
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    # A long admission window (it closes as soon as max_batch requests wait) admits the four together.
    engine = Engine(adapter, max_batch=4, batch_wait=0.5)
    await engine.start()
    try:
        handles = [engine.add_request(params(seed)) for seed in range(4)]
        results = [await h.result() for h in handles]
        alone = [await engine.add_request(params(seed)).result() for seed in range(2)]
    finally:
        await engine.stop()
        hook.remove()
    assert all(isinstance(r, Completed) for r in results)
    # Four requests x 3 steps: 3 forwards of 4 requests x 2 CFG rows; then 2 x 3 forwards of one request alone.
    assert calls == [8] * STEPS + [2] * (2 * STEPS), calls
    # And batching changed nothing.
    for batched, single in zip(results, alone, strict=False):
        np.testing.assert_allclose(batched.image, single.image, atol=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize(("window", "together"), [(0.4, True), (0.0, False)])
async def test_the_admission_window_admits_a_burst_as_one_batch(adapter, window, together):
    """Eight requests arriving 2 ms apart at an idle engine: with a window they start as one batch of 8 (16 CFG rows);
    without one, the first starts alone."""
    calls: list[int] = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    engine = Engine(adapter, max_batch=8, batch_wait=window)
    await engine.start()
    try:
        handles = []
        for seed in range(8):
            handles.append(engine.add_request(params(seed)))
            await asyncio.sleep(0.002)
        results = [await h.result() for h in handles]
    finally:
        await engine.stop()
        hook.remove()
    assert all(isinstance(r, Completed) for r in results)
    if together:
        assert calls == [16] * STEPS, calls
    else:
        assert calls[0] == 2, calls


@pytest.mark.asyncio
@pytest.mark.parametrize("returning", [True, False])
async def test_clients_of_a_finished_batch_come_back_as_one(adapter, returning):
    """Four requests arriving 1.5 ms apart: with a 20 ms window the short gap (0.5 ms) splits them, unless four
    requests just finished together; then the engine expects their clients back and waits with the long gap (5 ms).
    (3 ms apart left too little margin under the long gap on a loaded CI machine: the first started alone once.)"""
    calls: list[int] = []
    engine = Engine(adapter, max_batch=4, batch_wait=0.02)
    await engine.start()
    try:
        if returning:
            first = [engine.add_request(params(seed)) for seed in range(4)]  # queued at once: one batch
            assert all(isinstance(r, Completed) for r in [await h.result() for h in first])
        hook = adapter.transformer.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        handles = []
        for seed in range(4):
            handles.append(engine.add_request(params(10 + seed)))
            await asyncio.sleep(0.0015)
        assert all(isinstance(r, Completed) for r in [await h.result() for h in handles])
    finally:
        await engine.stop()
    hook.remove()
    if returning:
        assert calls == [8] * STEPS, calls
    else:
        assert calls[0] < 8, calls


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_sd3",
        "tiny_sd35",
        "tiny_sdxl",
        "tiny_flux",
        "tiny_kontext",
        "tiny_flux2klein",
        "tiny_flux2",
        "tiny_zimage",
        "tiny_ovis",
        "tiny_longcat",
        "tiny_longcat_edit",
        "tiny_glm_image",
        "tiny_qwenimage",
        "tiny_qwenimage_layered",
        "tiny_wan",
        "tiny_wan_i2v",
    ],
)
async def test_every_family_batches_its_forward(fixture, request):
    """Three requests with CFG (each family's own: guidance, or true CFG with a negative prompt) share every forward:
    3 x 2 rows per call (guidance-distilled families: 3 x 1). One forward per request would give calls of 2 rows
    (or 1). Instruction-edit families get an image to edit with each request."""
    adapter = load_adapter(request.getfixturevalue(fixture))
    calls: list[int] = []

    def count(module, args, kwargs):
        rows = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # Z-Image takes a list
        calls.append(len(rows))

    def edit(seed: int) -> dict:
        inputs = {"edit", "first-frame"} & set(adapter.capabilities.image_inputs)  # an image to edit or animate
        more = {"image": picture(64, 64, seed=seed)} if inputs else {}
        return {**more, "num_frames": 5} if adapter.capabilities.modality == "video" else more

    rows = 2 if {"cfg", "true-cfg"} & set(adapter.capabilities.guidance_styles) else 1
    hook = adapter.transformer.register_forward_pre_hook(count, with_kwargs=True)
    engine = Engine(adapter, max_batch=3, batch_wait=0.5)
    await engine.start()
    try:
        # (GLM-Image takes no negative prompt: its negative branch reads the empty one.)
        takes_negative = rows == 2 and adapter.capabilities.supports_negative_prompt
        negative = {"negative_prompt": "blurry"} if takes_negative else {}
        cfg = dict(width=64, height=64, **negative, **guidance(adapter, 4.0))
        handles = [
            engine.add_request(
                SamplingParams(prompt=f"a red circle {seed}", seed=seed, num_inference_steps=2, **cfg, **edit(seed))
            )
            for seed in range(3)
        ]
        results = [await h.result() for h in handles]
    finally:
        await engine.stop()
        hook.remove()
    assert all(isinstance(r, Completed) for r in results), results
    assert calls == [3 * rows, 3 * rows], calls


@pytest.mark.asyncio
async def test_skip_layer_guidance_shares_one_extra_forward(tiny_sd35):
    """Two requests with the same skipped layers, in their window at steps 1-3 of 4: each of those steps runs the
    batch's CFG forward (2 x 2 rows) and one skip-layer forward over both positive rows, not one per request."""
    adapter = load_adapter(tiny_sd35)
    calls: list[tuple[int, bool]] = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["hidden_states"].shape[0], bool(kwargs.get("skip_layers")))),
        with_kwargs=True,
    )
    engine = Engine(adapter, max_batch=2, batch_wait=0.5)
    await engine.start()
    try:
        slg = dict(skip_guidance_layers=(1,), skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)
        handles = [engine.add_request(params(seed, steps=4, **slg)) for seed in range(2)]
        results = [await h.result() for h in handles]
    finally:
        await engine.stop()
        hook.remove()
    assert all(isinstance(r, Completed) for r in results), results
    assert calls == [(4, False)] + [(4, False), (2, True)] * 3, calls
