"""Video with sound on the generic path: Kandinsky 6 (`Kandinsky6TI2VAPipeline`), which no dedicated family serves.
Each request's frames and sound track equal the pipeline's own call; requests admitted together share one call; a
native stream gives the clip (lossless WebP) and the MP4 of a job carries its AAC track."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import av
import diffusers
import numpy as np
import pytest
import torch
from engines import run_staggered
from sse import sse_events
from videos import decode_webp

from diffusiond.engine.outputs import Completed
from diffusiond.models.generic.adapter import GenericAdapter
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

CLIP = {"width": 64, "height": 64, "num_frames": 5}


@pytest.fixture(scope="module")
def kandinsky(tiny_kandinsky6):
    pipe = diffusers.Kandinsky6TI2VAPipeline.from_pretrained(tiny_kandinsky6)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, p: SamplingParams):
    out = pipe(
        prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width, num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps, generator=torch.Generator().manual_seed(p.seed), output_type="np",
    )  # fmt: skip
    return out.frames[0], out.audio[0]


def test_clips_with_sound_equal_the_pipeline_s_own_call(tiny_kandinsky6, kandinsky):
    adapter = load_adapter(tiny_kandinsky6)
    assert isinstance(adapter, GenericAdapter)
    caps = adapter.capabilities
    assert caps.modality == "video" and caps.audio_sample_rate == kandinsky.audio_sample_rate
    assert "first-frame" in caps.image_inputs and caps.default_fps == 24  # its `frame_rate` default
    requests = [
        SamplingParams(prompt="a dog barking", seed=1, num_inference_steps=3, **CLIP),
        SamplingParams(prompt="rain on a roof", seed=2, num_inference_steps=2, negative_prompt="noise", **CLIP),
        SamplingParams(prompt="a red circle on grass", seed=3, num_inference_steps=3, **CLIP),
    ]
    _, results, _ = asyncio.run(run_staggered(adapter, requests))
    for p, result in zip(requests, results, strict=True):
        assert isinstance(result, Completed), result
        frames, sound = reference(kandinsky, p)
        assert result.image.shape == frames.shape and float(np.abs(result.image - frames).max()) <= 1e-4
        assert result.audio is not None and result.audio.sample_rate == kandinsky.audio_sample_rate
        assert float(np.abs(result.audio.samples[0] - sound).max()) <= 1e-4


@pytest.mark.asyncio
async def test_a_native_stream_and_a_job_carry_the_clip_and_its_sound(serve, tiny_kandinsky6, kandinsky):
    server = serve(model=tiny_kandinsky6, max_pixels=64 * 64)
    body = {"prompt": "a dog barking", "seed": 4, "num_inference_steps": 2, **CLIP}
    frames, sound = reference(kandinsky, SamplingParams(**body))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{server.base_url}/v1/generations", json={**body, "video_format": "webp"}) as resp:
            assert resp.status == 200, await resp.text()
            events = [event async for event in sse_events(resp)]
        job = {"prompt": body["prompt"], "seed": 4, "num_inference_steps": 2, "num_frames": 5, "size": "64x64"}
        async with session.post(f"{server.base_url}/v1/videos", json=job) as resp:
            assert resp.status == 200, await resp.text()
            created = await resp.json()
        for _ in range(600):
            async with session.get(f"{server.base_url}/v1/videos/{created['id']}") as resp:
                created = await resp.json()
            if created["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.05)
        assert created["status"] == "completed", created
        async with session.get(f"{server.base_url}/v1/videos/{created['id']}/content") as resp:
            mp4 = await resp.read()
    name, data = events[-1]
    assert name == "completed" and data["video"]["format"] == "webp"  # the exact frames (WebP carries no sound)
    webp = decode_webp(base64.b64decode(data["video"]["b64"])).astype(float)
    assert np.abs(webp - (frames * 255).round()).max() <= 2
    with av.open(io.BytesIO(mp4)) as container:
        (audio,) = container.streams.audio
        assert audio.codec_context.name == "aac" and audio.rate == kandinsky.audio_sample_rate
        assert len(container.streams.video) == 1
    assert sound.shape[0] > 0
