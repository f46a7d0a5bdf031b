"""Each family make-tiny builds for the generic path, behind a live server (tests/daemon/test_generic_http.py does
SD 1.5): Stable Audio Open, Kandinsky 6, FLUX.3 [klein] (its Modular pipeline). Three native streams started a step
apart (mixed prompts, seeds, negative prompts, step counts) each equal the pipeline's own call (sound within 2/32767
as WAV, frames within 2/255 as lossless WebP, images within 2/255 as PNG), with progress (previews come where the
latents a call hands out are a map we read: not Stable Audio's 1-D sound latents, Kandinsky 6's 3-D VAE, which no
published map covers, nor FLUX.3's packed tokens); a DELETE ends the call at the next step; on a one-slot server a
higher class overtakes a running call, which resumes to the output it would have made (bitwise: the same file as
the request run again, never paused)."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from PIL import Image
from sse import sse_events
from videos import decode_webp

from diffusiond.daemon.audio_encoding import decode_wav

TIMEOUT = aiohttp.ClientTimeout(total=180)


def load_classic(name: str) -> Callable[[str], Any]:
    def load(path: str) -> Any:
        import diffusers

        pipe = getattr(diffusers, name).from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return load


def load_modular(path: str) -> Any:
    from diffusers.modular_pipelines import ModularPipeline

    pipe = ModularPipeline.from_pretrained(path)
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_args(body: dict) -> dict:
    return dict(
        prompt=body["prompt"], negative_prompt=body.get("negative_prompt"),
        num_inference_steps=body["num_inference_steps"], generator=torch.Generator().manual_seed(body["seed"]),
        **(body.get("arguments") or {}),
    )  # fmt: skip


def sound_of(pipe: Any, body: dict) -> np.ndarray:
    return np.clip(pipe(**call_args(body), output_type="np").audios[0], -1, 1)


def frames_of(pipe: Any, body: dict) -> np.ndarray:
    size = {k: body[k] for k in ("width", "height", "num_frames")}
    return (pipe(**call_args(body), **size, output_type="np").frames[0] * 255).round()


def image_of(pipe: Any, body: dict) -> np.ndarray:
    args = call_args(body)
    if body.get("guidance_scale") is not None:
        args["guidance_scale"] = body["guidance_scale"]
    image = pipe(**args, height=body["height"], width=body["width"], output="images", output_type="np")[0]
    return (image * 255).round()


def decode_sound(data: dict) -> np.ndarray:
    assert data["audio"]["format"] == "wav"
    return decode_wav(base64.b64decode(data["audio"]["b64"])).samples


def decode_frames(data: dict) -> np.ndarray:
    assert data["video"]["format"] == "webp"
    return decode_webp(base64.b64decode(data["video"]["b64"])).astype(float)


def decode_png(data: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data["images"][0]["b64"]))).convert("RGB")).astype(float)


@dataclass(frozen=True)
class Family:
    checkpoint: str  # the conftest fixture that builds it
    load: Callable[[str], Any]  # the pipeline, loaded as a user would
    reference: Callable[[Any, dict], np.ndarray]
    decode: Callable[[dict], np.ndarray]
    tolerance: float
    common: dict  # fields every request of the test sends
    prompts: tuple[str, str, str] = ("a dog barking", "rain on a roof", "a red circle on grass")
    serve: dict = field(default_factory=dict)  # the server's flags
    previews: bool = False  # the callback's latents are a VAE's map: previews come

    def bodies(self, long_steps: int | None = None) -> list[dict]:
        steps = (3, 2, 3) if long_steps is None else (long_steps,) * 3
        negatives = (None, "noise", "a cat")
        out = []
        for i, (prompt, n, negative) in enumerate(zip(self.prompts, steps, negatives, strict=True)):
            body = {"prompt": prompt, "seed": 11 + i, "num_inference_steps": n, **self.common}
            if negative is not None:
                body["negative_prompt"] = negative
            out.append(body)
        return out


VIDEO = {"width": 64, "height": 64, "num_frames": 5, "video_format": "webp"}
FAMILIES = {
    "stable-audio": Family(
        "tiny_stable_audio",
        load_classic("StableAudioPipeline"),
        sound_of,
        decode_sound,
        2 / 32767,
        {},
        serve={"adapter": "generic"},  # its dedicated family: tests/daemon/test_stable_audio.py
    ),
    "kandinsky6": Family(
        "tiny_kandinsky6",
        load_classic("Kandinsky6TI2VAPipeline"),
        frames_of,
        decode_frames,
        2,
        VIDEO,
        serve={"max_pixels": 64 * 64},
    ),
    # Its prompt upsampler's caption bounded to 4 tokens (a random upsampler writes hundreds before its end token).
    "flux3-klein": Family(
        "tiny_flux3_klein",
        load_modular,
        image_of,
        decode_png,
        2,
        {"width": 64, "height": 64, "arguments": {"max_new_tokens": 4}},
        serve={"max_pixels": 64 * 64},
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> tuple[Family, str, Any]:
    spec = FAMILIES[request.param]
    path = request.getfixturevalue(spec.checkpoint)
    return spec, path, spec.load(path)


async def stream(session, base_url: str, body: dict, on_event=None) -> list[tuple[str, dict]]:
    async with session.post(f"{base_url}/v1/generations", json=body) as resp:
        assert resp.status == 200, await resp.text()
        events = []
        async for name, data in sse_events(resp):
            events.append((name, data))
            if on_event is not None:
                await on_event(name, data, resp.headers["X-Request-Id"])
        return events


@pytest.mark.asyncio
async def test_staggered_streams_equal_the_pipeline_and_a_delete_ends_a_call(serve, family):
    spec, path, pipe = family
    server = serve(model=path, **spec.serve)
    bodies = spec.bodies()
    bodies[0]["preview_every"] = 1
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = [asyncio.Event() for _ in bodies]

        async def one(i: int):
            if i:
                await started[i - 1].wait()

            async def mark(name, data, rid):
                if name == "progress":
                    started[i].set()

            return await stream(session, server.base_url, bodies[i], mark)

        streams = await asyncio.gather(*(one(i) for i in range(len(bodies))))
        # A DELETE after a few steps: the call ends at the next step, its denoiser runs no more.
        forwards: list[int] = []
        denoiser = server.state.engine.adapter.pipe.transformer
        hook = denoiser.register_forward_pre_hook(lambda m, a: forwards.append(1))
        try:
            cancelled_at: dict[str, int] = {}

            async def cancel(name, data, rid):
                if name == "progress" and data["step"] >= 2 and not cancelled_at:
                    cancelled_at["forwards"] = len(forwards)
                    async with session.delete(f"{server.base_url}/v1/generations/{rid}") as resp:
                        assert resp.status == 202

            long = {**spec.bodies(long_steps=200)[0], "seed": 99}
            cancelled = await stream(session, server.base_url, long, cancel)
            await asyncio.sleep(0.3)
        finally:
            hook.remove()
    for body, events in zip(bodies, streams, strict=True):
        names = [n for n, _ in events]
        assert names[-1] == "completed", names
        progress = [d for n, d in events if n == "progress"]
        assert progress[-1]["step"] == progress[-1]["total"] == body["num_inference_steps"]
        if spec.previews and body.get("preview_every"):
            assert "preview" in names, names
        out = spec.decode(events[-1][1])
        expected = spec.reference(pipe, body)
        assert out.shape == expected.shape, (out.shape, expected.shape)
        assert float(np.abs(out - expected).max()) <= spec.tolerance, body["prompt"]
    assert cancelled[-1][0] == "cancelled", [n for n, _ in cancelled]
    # CFG runs one forward per step (the batch of two); the step in flight at most, then nothing
    assert len(forwards) - cancelled_at["forwards"] <= 2, (len(forwards), cancelled_at)
    assert not server.state.engine.adapter.rows


@pytest.mark.asyncio
async def test_a_higher_class_overtakes_a_running_call(serve, family):
    """One slot: a class-0 stream runs; a class-9 request arrives, is served first, and the class-0 call resumes to
    the output the pipeline makes."""
    spec, path, pipe = family
    server = serve(model=path, max_batch=1, **spec.serve)
    low, high = spec.bodies()[:2]
    low = {**low, "num_inference_steps": 12, "priority": 0}
    high = {**high, "priority": 9}
    order: list[str] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        urgent: list[asyncio.Task] = []

        async def send_high(name, data, rid):
            if name == "progress" and data["step"] >= 3 and not urgent:

                async def run():
                    events = await stream(session, server.base_url, high)
                    order.append("high")
                    return events

                urgent.append(asyncio.ensure_future(run()))

        events = await stream(session, server.base_url, low, send_high)
        order.append("low")
        high_events = await urgent[0]
        alone = await stream(session, server.base_url, low)  # the same request, never paused
    assert order == ["high", "low"], order
    names = [n for n, _ in events]
    assert "paused" in names and "resumed" in names, names
    assert "paused" not in [n for n, _ in alone] and not alone[-1][1].get("cached"), alone[-1][1].keys()
    assert high_events[-1][0] == "completed"
    out, expected = spec.decode(events[-1][1]), spec.reference(pipe, low)
    assert float(np.abs(out - expected).max()) <= spec.tolerance
    assert np.array_equal(out, spec.decode(alone[-1][1]))  # bitwise: the pause changed nothing
