"""Stable Audio Open's dedicated family behind a live server: four native streams started a step apart (prompts,
seeds, steps, a negative prompt, seconds cut, guidance with and without CFG) each equal the pipeline's own call as
WAV (within 2/32767), sharing the transformer's forwards; previews are pictures (the latent, or with `preview: "vae"`
the sound's envelope); `/v1/models` says what it makes and takes. Its jobs: tests/daemon/test_audio_jobs.py."""

from __future__ import annotations

import base64
import io

import aiohttp
import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from sse import staggered_streams

from diffusiond.daemon.audio_encoding import decode_wav
from diffusiond.models.tiny.audio import AUDIO_SAMPLE_RATE

TIMEOUT = aiohttp.ClientTimeout(total=180)

BODIES = [
    {"prompt": "a dog barking", "seed": 11, "num_inference_steps": 8, "preview_every": 1},
    {"prompt": "a piano note", "seed": 12, "num_inference_steps": 6, "negative_prompt": "noise", "preview": "vae",
     "preview_every": 2},
    {"prompt": "rain on a roof", "seed": 13, "num_inference_steps": 7, "guidance_scale": 3.0,
     "arguments": {"audio_start_in_s": 0.25, "audio_end_in_s": 0.75}},
    {"prompt": "a bell", "seed": 14, "num_inference_steps": 6, "arguments": {"audio_end_in_s": 0.5},
     "audio_format": "wav"},
]  # fmt: skip


def expected(pipe, body: dict) -> np.ndarray:
    wave = pipe(
        body["prompt"], negative_prompt=body.get("negative_prompt"), num_inference_steps=body["num_inference_steps"],
        guidance_scale=body.get("guidance_scale", 7.0), generator=torch.Generator().manual_seed(body["seed"]),
        output_type="np", **body.get("arguments", {}),
    ).audios[0]  # fmt: skip
    return np.clip(wave, -1, 1)


@pytest.mark.asyncio
async def test_staggered_streams_equal_the_call_and_share_forwards(serve, tiny_stable_audio):
    server = serve(model=tiny_stable_audio)
    adapter = server.state.engine.adapter
    assert adapter.capabilities.mode == "dedicated" and adapter.family == "stable-audio"
    forwards: list[int] = []
    hook = adapter.transformer.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(f"{server.base_url}/v1/models") as resp:
                (model,) = [entry["diffusiond"] for entry in (await resp.json())["data"]]
            images = f"{server.base_url}/v1/images/generations"
            async with session.post(images, json={"prompt": "a dog", "size": "64x64"}) as resp:
                error = (await resp.json())["error"]  # sound is not an image: the routes that make it are named
                assert resp.status == 400 and "/v1/audio/generations" in error["message"], error
            streams = await staggered_streams(session, f"{server.base_url}/v1/generations", BODIES)
    finally:
        hook.remove()
    assert model["modality"] == "audio" and model["audio_sample_rate"] == AUDIO_SAMPLE_RATE, model
    assert model["arguments"] == ["audio_start_in_s", "audio_end_in_s"], model
    pipe = diffusers.StableAudioPipeline.from_pretrained(tiny_stable_audio)
    pipe.set_progress_bar_config(disable=True)
    for body, events in zip(BODIES, streams, strict=True):
        names = [n for n, _ in events]
        assert names[-1] == "completed", names
        audio = events[-1][1]["audio"]
        sound = decode_wav(base64.b64decode(audio["b64"]))
        reference = expected(pipe, body)
        assert (audio["format"], sound.sample_rate) == ("wav", AUDIO_SAMPLE_RATE)
        assert sound.samples.shape == reference.shape, (sound.samples.shape, reference.shape)
        diff = float(np.abs(sound.samples - reference).max())
        print(f"{body['prompt']!r}: {reference.shape}, max abs diff {diff * 32767:.2f}/32767")
        assert diff <= 2 / 32767
    previews = {i: [d for n, d in events if n == "preview"] for i, events in enumerate(streams)}
    assert [p["step"] for p in previews[0]] == list(range(1, 8)) and [p["step"] for p in previews[1]] == [2, 4]
    fast = Image.open(io.BytesIO(base64.b64decode(previews[0][0]["b64"])))
    vae = Image.open(io.BytesIO(base64.b64decode(previews[1][0]["b64"])))
    assert fast.size == (adapter.transformer.config.sample_size * 4, adapter.transformer.config.in_channels * 4)
    assert vae.size == (256, 2 * 48)  # the envelope of each of its two channels
    steps = sum(body["num_inference_steps"] for body in BODIES)
    print(f"{len(forwards)} forwards for {steps} request steps")
    assert len(forwards) < steps - 6, "the streams ran their own forwards"
