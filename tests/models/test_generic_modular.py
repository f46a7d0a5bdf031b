"""Modular pipelines on the generic path (models/generic/loading.py): a folder with `modular_model_index.json` loads
as a `ModularPipeline` and its denoise loop (`LoopSequentialPipelineBlocks.loop_step`) gives control back before its
first step and after each. FLUX.1's components as `FluxModularPipeline` (`make-tiny --family flux-modular`): each
request equals the Modular pipeline's own call; its progress counts the loop's steps; a cancel stops its loop."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from engines import run_staggered

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Cancelled, Completed, Progress
from diffusiond.models.generic.adapter import GenericAdapter
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams


@pytest.fixture(scope="module")
def modular(tiny_flux_modular):
    from diffusers.modular_pipelines import ModularPipeline

    pipe = ModularPipeline.from_pretrained(tiny_flux_modular)
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, p: SamplingParams) -> np.ndarray:
    return pipe(
        prompt=p.prompt, height=64, width=64, num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale if p.guidance_scale is not None else 3.5,
        generator=torch.Generator().manual_seed(p.seed), output="images", output_type="np",
    )[0]  # fmt: skip


def test_a_modular_folder_loads_on_the_generic_path(tiny_flux_modular):
    adapter = load_adapter(tiny_flux_modular)
    assert isinstance(adapter, GenericAdapter) and adapter.call.modular and adapter.call.steps == "loop"
    caps = adapter.capabilities.public()
    assert caps["mode"] == "generic" and caps["pipeline"] == "FluxModularPipeline"
    assert "guidance_scale" in caps["fields"] and "num_inference_steps" in caps["fields"]


def test_staggered_requests_equal_the_modular_pipeline_s_own_call(tiny_flux_modular, modular):
    requests = [
        SamplingParams(prompt="a red circle", seed=1, width=64, height=64, num_inference_steps=4),
        SamplingParams(prompt="a blue square", seed=2, width=64, height=64, num_inference_steps=3, guidance_scale=5.0),
        SamplingParams(prompt="a green cat", seed=3, width=64, height=64, num_inference_steps=4),
    ]
    _, results, _ = asyncio.run(run_staggered(load_adapter(tiny_flux_modular), requests))
    for p, result in zip(requests, results, strict=True):
        assert isinstance(result, Completed), result
        assert float(np.abs(result.image - reference(modular, p)).max()) <= 1e-4


def test_progress_counts_the_loop_s_steps_and_a_cancel_stops_it(tiny_flux_modular):
    adapter = load_adapter(tiny_flux_modular)
    steps = []
    hook = adapter.pipe.transformer.register_forward_pre_hook(lambda m, a: steps.append(1))

    async def run():
        engine = Engine(adapter, max_batch=1)
        await engine.start()
        try:
            first = SamplingParams(prompt="x", seed=1, width=64, height=64, num_inference_steps=3)
            assert isinstance(await engine.add_request(first).result(), Completed)
            handle = engine.add_request(SamplingParams(prompt="y", seed=2, width=64, height=64, num_inference_steps=50))
            events = []
            async for event in handle.events():
                events.append(event)
                if isinstance(event, Progress) and event.step >= 2:  # (a slow reader's progress is coalesced)
                    engine.cancel(handle.request_id)
            return events
        finally:
            await engine.stop()

    try:
        events = asyncio.run(run())
    finally:
        hook.remove()
    progress = [(e.step, e.total) for e in events if isinstance(e, Progress)]
    assert progress and all(total == 50 for _, total in progress) and isinstance(events[-1], Cancelled), events[-1]
    ran = len(steps) - 3  # the first request's 3 steps
    assert ran <= progress[-1][0] + 1, (ran, progress)  # the second's until the cancel, and the step in flight
