"""Helpers for tests that run requests through an Engine in the test's process.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from engines import ...`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect

import numpy as np
import torch

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import TERMINAL, Completed, Progress
from diffusiond.models.params import SamplingParams


def guidance(adapter, scale: float) -> dict:
    """The guidance knobs `adapter`'s checkpoint takes, each at `scale` (a knob it would ignore is refused)."""
    styles = set(adapter.capabilities.guidance_styles)
    knobs = {"guidance_scale": scale} if {"cfg", "distilled", "skip-layer"} & styles else {}
    return {**knobs, "true_cfg_scale": scale} if "true-cfg" in styles else knobs


def generate(adapter, seeds=(1, 2), steps: int = 3) -> list[np.ndarray]:
    """64x64 images of "a shape {seed}" for each seed, the requests batched together in every forward."""

    async def run():
        engine = Engine(adapter, max_batch=4, batch_wait=0.5)  # both requests in every forward
        await engine.start()
        try:
            handles = [
                engine.add_request(
                    SamplingParams(prompt=f"a shape {s}", seed=s, width=64, height=64, num_inference_steps=steps)
                )
                for s in seeds
            ]
            results = [await h.result() for h in handles]
        finally:
            await engine.stop()
        assert all(isinstance(r, Completed) for r in results), results
        return [r.image for r in results]

    return asyncio.run(run())


async def run_staggered(adapter, requests):
    """Submit each request once the previous one has made progress, so later ones join a running batch."""
    engine = Engine(adapter, max_batch=8)
    plans = []
    execute = engine.executor.execute

    def recording_execute(plan):
        plans.append(plan)
        return execute(plan)

    engine.executor.execute = recording_execute
    await engine.start()
    try:
        handles, ended = [], {}
        for params in requests:
            handle = engine.add_request(params)
            handles.append(handle)
            if len(handles) < len(requests):
                async for event in handle.events():
                    if isinstance(event, Progress):
                        break
                    if isinstance(event, TERMINAL):  # failed before its first step: result() would wait forever
                        ended[handle.request_id] = event
        results = await asyncio.gather(
            *(asyncio.sleep(0, ended[h.request_id]) if h.request_id in ended else h.result() for h in handles)
        )
    finally:
        await engine.stop()
    return handles, results, plans


def reference(pipe, family: str, params: SamplingParams, **extra) -> np.ndarray:
    """The pipeline's own `__call__` with the parameters each family's pipeline takes (`params` resolved), and
    `extra` (an Img2Img pipeline's image and strength)."""
    generator = torch.Generator().manual_seed(params.seed)
    kwargs = dict(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        width=params.width,
        height=params.height,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        generator=generator,
        output_type="np",
    )
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs.update(params.arguments or {})  # a family's call switches a request sets by name (LongCat-Image's)
    if family in ("flux", "qwen-image", "qwen-image-edit-plus", "qwen-image-21"):
        kwargs["true_cfg_scale"] = params.true_cfg_scale
    if "guidance_scale" not in accepted:  # Qwen-Image 2.1: true CFG only
        del kwargs["guidance_scale"]
    elif family.startswith("qwen-image") and not pipe.transformer.config.guidance_embeds:
        kwargs["guidance_scale"] = None
    if params.skip_guidance_layers is not None:
        kwargs["skip_guidance_layers"] = list(params.skip_guidance_layers)
        for name in ("skip_layer_guidance_scale", "skip_layer_guidance_start", "skip_layer_guidance_stop"):
            kwargs[name] = getattr(params, name)
    if "width" not in accepted:  # sized by its input image (SDXL's Img2Img)
        del kwargs["width"], kwargs["height"]
    if "negative_prompt" not in accepted:  # FLUX.2 [klein]: its negative is "" unless handed as embeddings
        negative = kwargs.pop("negative_prompt")
        if negative is not None:
            kwargs["negative_prompt_embeds"] = pipe.encode_prompt(prompt=negative)[0]
    if getattr(pipe.scheduler.config, "stochastic_sampling", False):
        # The flow-matching pipelines do not hand their generator to `scheduler.step`, so a stochastic scheduler's
        # noise would come from torch's global generator; diffusiond draws it from the request's (the seed fixes
        # the image). The reference does the same: the pipeline's call, with its generator threaded through.
        step = pipe.scheduler.step
        pipe.scheduler.step = functools.partial(step, generator=generator)
        try:
            return pipe(**{**kwargs, **extra}).images[0]
        finally:
            del pipe.scheduler.step  # the class's method again
    return pipe(**{**kwargs, **extra}).images[0]
