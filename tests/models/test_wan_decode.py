"""A clip's VAE decode in pieces (issue 34; engine/executor.py `_decode_pieces`, models/families/wan/adapter.py
`wan_pieces`): Wan decodes one latent frame per piece, a piece per step, so that a finishing low-class clip's decode
does not hold up a higher class's steps. The pieces give `decode`'s frames exactly (Wan 2.1 T2V, and TI2V-5B's
patchified VAE with its given first frame pinned); a class-9 request that takes the slot of a finishing class-0 clip
completes before the clip's decode does, and the clip's frames equal the clip decoded alone. Broken on purpose once:
with the plans' `decode` left None (every finished clip decoded whole in the step it finishes), the clip completed first
(red)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed, Progress
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams


def clip(prompt: str, frames: int = 9, steps: int = 2, **more) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=3, width=64, height=32, num_frames=frames, num_inference_steps=steps, **more
    )


def _upsampler(block):
    return block.upsampler if hasattr(block, "upsampler") else (block.upsamplers or [None])[0]


def in_pieces(adapter, state) -> tuple[list[np.ndarray], int]:
    pieces = adapter.decode_in_pieces([state])
    count = 0
    while True:
        count += 1
        try:
            next(pieces)
        except StopIteration as done:
            return done.value, count


@pytest.mark.parametrize("checkpoint", ["tiny_wan", "tiny_wan22_ti2v"])
def test_pieces_equal_the_whole_decode(checkpoint, request):
    adapter = load_adapter(request.getfixturevalue(checkpoint))
    [state] = adapter.prepare([("a", adapter.resolve(clip("a red cat")))])
    whole = adapter.decode([state])
    pieces, count = in_pieces(adapter, state)
    # 9 frames: 3 latent frames, each in pieces: input and middle, each resnet and upsampler of the up blocks, the head
    layers = sum(len(b.resnets) + (_upsampler(b) is not None) for b in adapter.vae.decoder.up_blocks)
    assert state.latents.shape[2] == 3 and layers > len(adapter.vae.decoder.up_blocks) and count == 3 * (2 + layers)
    assert pieces[0].shape == whole[0].shape == (9, 32, 64, 3)
    assert np.array_equal(pieces[0], whole[0])


async def run(adapter, low: SamplingParams, high: SamplingParams | None) -> tuple[list[str], dict[str, np.ndarray]]:
    """`low` (class 0) in the only slot; `high` (class 9) sent once `low` steps, waiting for the slot (preemption
    off). The order the requests completed in, and their frames."""
    engine = Engine(adapter, max_batch=1, max_running=1)
    engine.scheduler.preemption = False
    await engine.start()
    try:
        order, frames, handles = [], {}, []

        async def follow(name: str, handle) -> None:
            async for event in handle.events():
                if isinstance(event, Progress) and name == "low" and high is not None and not handles:
                    handles.append(asyncio.create_task(follow("high", engine.add_request(high, priority=9))))
                if isinstance(event, Completed):
                    order.append(name)
                    frames[name] = event.image

        await follow("low", engine.add_request(low, priority=0))
        await asyncio.gather(*handles)
    finally:
        await engine.stop()
    return order, frames


def test_a_finished_clip_decode_waits_for_a_higher_class(tiny_wan):
    adapter = load_adapter(tiny_wan)
    low, high = clip("a long low scene"), clip("an urgent cat", frames=1)
    order, frames = asyncio.run(run(adapter, low, high))
    assert order == ["high", "low"], order
    _, alone = asyncio.run(run(adapter, low, None))
    assert np.array_equal(frames["low"], alone["low"])
