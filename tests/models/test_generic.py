"""The generic path (models/generic/): a pipeline without a dedicated family (Stable Diffusion 1.5 here) served through
its own call a step at a time, each request's image equal to the pipeline's own call for its parameters; calls
interleaved by the engine's scheduler (batched calls, cancel, preemption), previews from each call's own latents.

Through HTTP: tests/daemon/test_generic_http.py. Layouts a dedicated family does not read, and `--adapter generic`
on dedicated families: tests/models/test_generic_fallback.py.
"""

from __future__ import annotations

import asyncio

import diffusers
import msgspec
import numpy as np
import pytest
import torch
from engines import run_staggered

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Cancelled, Completed, Paused, Preview, Progress, Resumed
from diffusiond.models.generic.adapter import GenericAdapter
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import ParamError, SamplingParams


@pytest.fixture(scope="module")
def sd15(tiny_sd15):
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_sd15)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, p: SamplingParams, callback=None) -> np.ndarray:
    """The pipeline's own call for `p` (one image, its seed's generator)."""
    kwargs = {"callback_on_step_end": callback} if callback is not None else {}
    return pipe(
        p.prompt,
        negative_prompt=p.negative_prompt,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale if p.guidance_scale is not None else 7.5,
        generator=torch.Generator().manual_seed(p.seed),
        output_type="np",
        **(p.arguments or {}),
        **kwargs,
    ).images[0]


def params(prompt: str, seed: int, steps: int = 4, **more) -> SamplingParams:
    return SamplingParams(prompt=prompt, seed=seed, num_inference_steps=steps, **more)


def test_a_pipeline_without_a_family_is_served_generically(tiny_sd15):
    adapter = load_adapter(tiny_sd15)
    assert isinstance(adapter, GenericAdapter)
    caps = adapter.capabilities.public()
    assert caps["mode"] == "generic" and caps["pipeline"] == "StableDiffusionPipeline"
    # The pipeline's own defaults: 50 steps, 7.5 guidance, its UNet's sample size x the VAE's scale.
    assert (caps["default_steps"], caps["default_guidance_scale"], caps["default_size"]) == (50, 7.5, "64x64")
    assert "eta" in caps["fields"] and "prompt" not in caps["fields"] and "generator" not in caps["fields"]


def test_staggered_requests_equal_the_pipeline_s_own_call(tiny_sd15, sd15):
    """Mixed prompts, seeds, negative prompts and step counts, each arriving while the others run: each image is the
    pipeline's own call for its parameters (PNDM: a call of N steps runs N + 1 timesteps, reported as such)."""
    requests = [
        params("a red circle", 1, 4, negative_prompt="blue"),
        params("a blue square on a green background", 2, 6),
        params("a small white triangle", 3, 4, negative_prompt="a dog", guidance_scale=4.0),
        params("a cat", 4, 5, arguments={"eta": 0.0}),
    ]
    _, results, _ = asyncio.run(run_staggered(load_adapter(tiny_sd15), requests))
    for p, result in zip(requests, results, strict=True):
        assert isinstance(result, Completed), result
        diff = float(np.abs(result.image - reference(sd15, p)).max())
        print(f"{p.prompt!r} seed {p.seed} steps {p.num_inference_steps}: max abs diff {diff:.2e}")
        assert diff <= 1e-4


async def collect(adapter, requests, *, max_batch: int = 4, batch_wait: float = 0.5, **engine_kwargs):
    engine = Engine(adapter, max_batch=max_batch, batch_wait=batch_wait, **engine_kwargs)
    await engine.start()
    try:
        handles = [engine.add_request(p) for p in requests]
        events = {h.request_id: [] for h in handles}

        async def watch(handle):
            async for event in handle.events():
                events[handle.request_id].append(event)

        await asyncio.gather(*(watch(h) for h in handles))
    finally:
        await engine.stop()
    return [events[h.request_id] for h in handles]


def test_requests_admitted_together_share_one_call_each_with_its_own_image(tiny_sd15, sd15):
    """Equal call arguments but prompt, negative prompt and seed: one call with a list of prompts and a generator
    per image, each image the one its request gets alone (a generator shared by the batch: red)."""
    adapter = load_adapter(tiny_sd15)
    calls, rows = [], []
    real = type(adapter.pipe).__call__

    def counted(pipe, *args, **kwargs):
        calls.append(len(kwargs["prompt"]))
        return real(pipe, *args, **kwargs)

    adapter.pipe.__class__ = type("Counted", (type(adapter.pipe),), {"__call__": counted})
    hook = adapter.pipe.unet.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    requests = [params(f"a shape {s}", s, 4, negative_prompt="blurry") for s in (1, 2, 3)]
    try:
        events = asyncio.run(collect(adapter, requests))
    finally:
        hook.remove()
    assert calls == [3], calls  # one call for the three
    assert set(rows) == {6}, rows  # each step: one UNet forward over their 2 x 3 CFG rows
    images = [next(e for e in ev if isinstance(e, Completed)).image for ev in events]
    for p, image in zip(requests, images, strict=True):
        assert float(np.abs(image - reference(sd15, p)).max()) <= 1e-4
    assert float(np.abs(images[0] - images[1]).max()) > 0.1  # seeds of their own


def test_a_cancelled_call_stops_at_the_next_step(tiny_sd15):
    """DELETE after two steps: the request ends cancelled and its call runs no step after that (a call run to its
    end after the cancel: red)."""
    adapter = load_adapter(tiny_sd15)
    forwards = []
    hook = adapter.pipe.unet.register_forward_pre_hook(lambda module, args: forwards.append(1))

    async def run():
        engine = Engine(adapter, max_batch=1)
        await engine.start()
        try:
            handle = engine.add_request(params("a long one", 5, 40))
            events, at = [], []
            async for event in handle.events():
                events.append(event)
                if isinstance(event, Progress) and event.step >= 2 and not at:  # (a slow reader's are coalesced)
                    at.append(event.step)
                    engine.cancel(handle.request_id)
            counted = len(forwards)
            await asyncio.sleep(0.3)  # nothing of it runs any more
            return events, counted, at[0]
        finally:
            await engine.stop()

    try:
        events, at_end, cancelled_at = asyncio.run(run())
    finally:
        hook.remove()
    assert isinstance(events[-1], Cancelled), events[-1]
    steps = max(e.step for e in events if isinstance(e, Progress))
    # The steps seen when it was cancelled, and at most the one in flight then; none after its terminal event.
    assert steps <= cancelled_at + 1 and len(forwards) == at_end <= cancelled_at + 2, (steps, len(forwards))
    assert not adapter.rows  # its call is gone


def test_a_higher_class_overtakes_a_running_call_and_it_resumes_to_the_same_image(tiny_sd15):
    """One slot: a class-5 request arriving while a class-0 call runs pauses it (its greenlet not resumed) and runs
    first; the paused call then goes on to the image it makes alone, bitwise (a priority ignored: red)."""
    adapter = load_adapter(tiny_sd15)
    low = params("a patient shape", 7, 12)

    async def run():
        engine = Engine(adapter, max_batch=1, max_running=1)
        await engine.start()
        try:
            handle = engine.add_request(low, priority=0)
            events, urgent, order = [], None, []
            async for event in handle.events():
                events.append(event)
                if isinstance(event, Progress) and event.step >= 3 and urgent is None:
                    high = msgspec.structs.replace(low, prompt="an urgent shape", seed=1000, num_inference_steps=4)
                    urgent = engine.add_request(high, priority=5)
                    urgent_done = asyncio.ensure_future(urgent.result())
                    urgent_done.add_done_callback(lambda _: order.append("high"))
                if isinstance(event, Completed):
                    order.append("low")
            assert isinstance(await urgent_done, Completed)
            alone = await engine.add_request(low).result()
            return events, order, alone
        finally:
            await engine.stop()

    events, order, alone = asyncio.run(run())
    assert order == ["high", "low"], order
    pauses = [e for e in events if isinstance(e, Paused)]
    resumes = [e for e in events if isinstance(e, Resumed)]
    assert len(pauses) == len(resumes) == 1 and pauses[0].step == resumes[0].step
    (completed,) = [e for e in events if isinstance(e, Completed)]
    assert np.array_equal(completed.image, alone.image)


def test_previews_come_from_each_call_s_own_latents(tiny_sd15, sd15):
    """Every preview is the fast map of its own request's latents after that step, as the pipeline's callback
    hands them out (previews from another request of the batch: red)."""
    adapter = load_adapter(tiny_sd15)
    requests = [params(f"a shape {s}", s, 3, negative_prompt="x", preview_every=1) for s in (11, 12)]
    events = asyncio.run(collect(adapter, requests))
    for p, ev in zip(requests, events, strict=True):
        latents = []

        def keep(pipe, i, t, tensors, latents=latents):
            latents.append(tensors["latents"][0].clone())
            return tensors

        reference(sd15, p, callback=keep)
        previews = [e for e in ev if isinstance(e, Preview)]
        assert [e.step for e in previews] == list(range(1, len(latents)))  # not at the last step
        for preview in previews:
            assert np.array_equal(preview.image, adapter.latent_rgb.to_uint8(latents[preview.step - 1]))


def test_fields_the_call_does_not_take_are_refused_by_name(tiny_sd15):
    adapter = load_adapter(tiny_sd15)
    for p, field in (
        (params("x", 1, true_cfg_scale=4.0), "true_cfg_scale"),  # StableDiffusionPipeline takes no true CFG
        (params("x", 1, num_frames=5), "num_frames"),
        (params("x", 1, arguments={"wings": 2}), "arguments"),
        (params("x", 1, arguments={"latents": 2}), "arguments"),  # the server's to pass
        (params("x", 1, images={"control_image": b"png"}), "images"),
        (params("x", 1, width=65), "height"),  # the pipeline's own check_inputs: divisible by 8
        (params("x", 1, lora=()), None),
    ):
        if field is None:
            adapter.resolve(p)
            continue
        with pytest.raises(ParamError) as info:
            adapter.resolve(p)
        assert info.value.param in (field, "width"), (field, info.value.param, str(info.value))
    resolved = adapter.resolve(params("x", 1, arguments={"eta": 0.5}))
    assert resolved.arguments == {"eta": 0.5} and resolved.width == resolved.height == 64
