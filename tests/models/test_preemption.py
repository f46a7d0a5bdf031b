"""Preemption at step boundaries (issue 34; engine/scheduler.py, engine/parking.py): a class-0 request paused for
class-5 requests and resumed, once or several times, with a step cache and LoRA adapters on, ends with exactly the
image (a video family: the clip) it gets uninterrupted. One slot (max_running=1), so each class-5 arrival pauses it.

Paused states are moved to "host memory" and back through a parking that copies every tensor (on the CPU a real
parking moves nothing): the walk that a GPU's offload relies on must find and restore everything the request needs.
Broken on purpose once: a resume that prepared the request again (its sampler and latents from the start) went red.
"""

from __future__ import annotations

import asyncio
import gc

import msgspec
import numpy as np
import pytest
import torch

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed, Paused, Progress, Resumed
from diffusiond.engine.parking import Parking, move_tensors
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import LoraChoice, SamplingParams
from diffusiond.models.tiny.lora import build_tiny_lora


class CopyingParking(Parking):
    """Moves every tensor of a paused state to a copy and back (what a GPU's offload does, on the CPU)."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.offloads = True
        self.parked_bytes: list[int] = []

    def moves(self, tensor: torch.Tensor) -> bool:
        return True

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def park(self, state) -> None:
        super().park(state)
        self.parked_bytes.append(self.held[state.request_id][0])


async def interrupted(adapter, low: SamplingParams, arrivals: list[int], copying: bool):
    """`low` at class 0 alone in one slot; after its `arrivals[k]`-th step a class-5 request arrives. Its events."""
    engine = Engine(adapter, max_batch=1, max_running=1)
    if copying:
        engine.executor.parking = CopyingParking(adapter.capabilities.device)
    await engine.start()
    try:
        handle = engine.add_request(low, priority=0)
        events, urgent, todo = [], [], list(arrivals)
        async for event in handle.events():
            events.append(event)
            if isinstance(event, Progress) and todo and event.step >= todo[0]:
                todo.pop(0)
                high = msgspec.structs.replace(low, prompt="an urgent shape", seed=1000 + len(urgent), lora=None)
                urgent.append(engine.add_request(high, priority=5))
        for h in urgent:
            assert isinstance(await h.result(), Completed)
        parked = engine.executor.parking.parked_bytes if copying else []
    finally:
        await engine.stop()
    return events, parked


async def alone(adapter, params: SamplingParams) -> np.ndarray:
    engine = Engine(adapter, max_batch=1, max_running=1)
    await engine.start()
    try:
        result = await engine.add_request(params).result()
    finally:
        await engine.stop()
    assert isinstance(result, Completed)
    return result.image


def check(adapter, low: SamplingParams, arrivals: list[int], copying: bool) -> None:
    events, parked = asyncio.run(interrupted(adapter, low, arrivals, copying))
    pauses = [e for e in events if isinstance(e, Paused)]
    resumes = [e for e in events if isinstance(e, Resumed)]
    assert len(pauses) == len(resumes) == len(arrivals), events
    assert [p.step for p in pauses] == [r.step for r in resumes]  # it goes on from where it stopped
    assert all(0 < p.step < low.num_inference_steps for p in pauses)
    if copying:
        assert len(parked) == len(arrivals) and all(b > 0 for b in parked)
    (completed,) = [e for e in events if isinstance(e, Completed)]
    expected = asyncio.run(alone(adapter, low))
    assert completed.image.shape == expected.shape
    diff = float(np.abs(completed.image - expected).max())
    print(f"paused {len(pauses)}x at steps {[p.step for p in pauses]}: max abs diff {diff:.2e}")
    assert diff == 0.0


def image(steps: int = 8, **more) -> SamplingParams:
    return SamplingParams(prompt="a patient shape", seed=7, width=64, height=64, num_inference_steps=steps, **more)


def test_paused_once_the_image_is_unchanged(tiny_sd3):
    check(load_adapter(tiny_sd3), image(), [2], copying=False)


def test_paused_twice_with_a_step_cache_and_lora_the_image_is_unchanged(tiny_sd3, tmp_path):
    adapter = load_adapter(tiny_sd3)
    adapter.enable_step_cache("fbcache", 0.0)
    registry = adapter.enable_lora(1 << 30)
    registry.register("ink", str(build_tiny_lora(tiny_sd3, tmp_path / "ink.safetensors", seed=1)))
    low = image(cache_threshold=0.3, lora=(LoraChoice("ink", 0.8),))
    check(adapter, low, [2, 5], copying=True)


def clip(steps: int = 8) -> SamplingParams:
    return SamplingParams(
        prompt="a patient shape",
        seed=7,
        width=48,
        height=32,
        num_frames=5,
        num_inference_steps=steps,
        guidance_scale=4.0,
    )


def test_a_clip_paused_twice_is_unchanged(tiny_wan):
    check(load_adapter(tiny_wan), clip(), [2, 5], copying=True)


def reachable_tensors(root, skip: tuple) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through the garbage collector's referents (independent of the walk in
    engine/parking.py), not entering modules, classes, functions or `skip`."""
    found, seen, todo = [], {id(x) for x in skip}, [(root, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, torch.nn.Module | type | type(gc) | str | bytes):
            continue
        if callable(obj) and not hasattr(obj, "__dict__"):  # builtins, methods' functions
            continue
        todo += [(x, depth + 1) for x in gc.get_referents(obj)]
    return found


@pytest.mark.parametrize("fixture", ["tiny_sd3", "tiny_wan"])
def test_the_walk_finds_every_tensor_a_state_holds(fixture, request):
    """After two steps with a step cache (its residuals are state too), moving a state's tensors to the meta device
    leaves none of its own reachable on the CPU."""
    adapter = load_adapter(request.getfixturevalue(fixture))
    if "fbcache" in adapter.capabilities.cache_methods:
        adapter.enable_step_cache("fbcache", 0.0)
    params = adapter.resolve(image(steps=4, cache_threshold=0.3) if fixture == "tiny_sd3" else clip(steps=4))
    (state,) = adapter.prepare([("r", params)])
    for _ in range(2):
        out = adapter.denoise([state])
        adapter.step([state], out)
    before = [t for t in reachable_tensors(state, (state.params, state.lora)) if t.device.type == "cpu"]
    assert len(before) >= 3  # latents, conditioning, the sampler's sigmas at least
    move_tensors(state, lambda t: t.to("meta"))
    left = [t for t in reachable_tensors(state, (state.params, state.lora)) if t.device.type == "cpu"]
    assert not left, [tuple(t.shape) for t in left]
