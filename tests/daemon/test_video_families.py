"""The video families beyond Wan over HTTP. Video with sound, on the tiny LTX-2: the MP4 of `/v1/videos/{id}/content`
(through the official openai client) carries an AAC track whose decoded samples are the pipeline's waveform, and the
native stream says so. HunyuanVideo-1.5's text- and image-to-video checkpoints serve video jobs.

Tolerance: AAC is lossy. On the tiny model's noise-like waveform FFmpeg's encoder at 128 kbit/s per channel keeps
a signal-to-noise ratio of about 20 dB (a tone: 30 dB); the test asks for 15 dB, and that another seed's waveform,
which shares much of the tiny model's sound (6 dB), is at least 8 dB further. The samples are compared from the
first: the file's edit list skips the encoder's priming.
"""

from __future__ import annotations

import base64
import io

import aiohttp
import av
import diffusers
import numpy as np
import openai
import pytest
import torch
from conftest import API_KEY
from pictures import picture
from sse import sse_events

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

PROMPT = "a red cat walking on the grass"
FRAMES, STEPS = 17, 3


@pytest.fixture(scope="module")
def sound_server(serve, tiny_ltx2):
    return serve(model=tiny_ltx2, api_key=API_KEY, max_pixels=64 * 64)


def decode_sound(data: bytes) -> tuple[np.ndarray, int, int]:
    """The MP4's AAC track as float32 [channels, samples], its sample rate, and its video frame count."""
    with av.open(io.BytesIO(data)) as container:
        (stream,) = container.streams.audio
        assert stream.codec_context.name == "aac"
        samples = np.concatenate([frame.to_ndarray() for frame in container.decode(stream)], axis=1)
        rate = stream.sample_rate
    with av.open(io.BytesIO(data)) as container:
        frames = sum(1 for _ in container.decode(container.streams.video[0]))
    return samples, rate, frames


def snr_db(signal: np.ndarray, decoded: np.ndarray) -> float:
    decoded = decoded[:, : signal.shape[1]]
    return float(10 * np.log10((signal**2).mean() / ((decoded - signal) ** 2).mean()))


def pipeline_audio(checkpoint: str, seed: int) -> np.ndarray:
    pipe = diffusers.LTX2Pipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    _, audio = pipe(
        prompt=PROMPT,
        width=64,
        height=64,
        num_frames=FRAMES,
        frame_rate=24.0,
        num_inference_steps=STEPS,
        spatio_temporal_guidance_blocks=[28],  # the pipeline's default, past the tiny model's blocks: no STG
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        return_dict=False,
    )
    return np.asarray(audio[0])


def test_the_mp4_carries_the_pipeline_s_sound(sound_server, tiny_ltx2):
    with openai.OpenAI(base_url=f"{sound_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        model = client.models.list().data[0]
        assert model.model_extra["diffusiond"]["audio_sample_rate"] == 24000
        job = client.videos.create_and_poll(
            model=model.id,
            prompt=PROMPT,
            size="64x64",
            poll_interval_ms=20,
            extra_body={"seed": 5, "num_inference_steps": STEPS, "num_frames": FRAMES},
        )
        assert job.status == "completed", job
        content = client.videos.download_content(job.id)
        assert content.response.headers["content-type"] == "video/mp4"
        samples, rate, frames = decode_sound(content.read())
    expected, other = pipeline_audio(tiny_ltx2, 5), pipeline_audio(tiny_ltx2, 6)
    assert (rate, frames, samples.shape[0]) == (24000, FRAMES, 2)
    # 17 frames at 24 fps: 0.708 s, 18 audio latents of 40 ms; the causal audio decoder makes 4 x 18 - 3 = 69 mel frames
    # of 240 samples. The AAC track ends on a whole 1024-sample frame.
    assert expected.shape == (2, 16560) and expected.shape[1] <= samples.shape[1] < expected.shape[1] + 1024
    ours, theirs = snr_db(expected, samples), snr_db(expected, other)
    print(f"AAC track vs the pipeline's waveform: {ours:.1f} dB; another seed's waveform: {theirs:.1f} dB")
    assert ours >= 15.0 and theirs < ours - 8.0


def test_an_image_starts_a_clip_with_sound(sound_server):
    """`input_reference` (multipart, as the openai client sends it): the clip starts from the image, with sound; the
    audio-video guidance knobs are extra body fields (multipart: `stg_blocks` as a JSON list)."""
    extra = {"seed": 2, "num_inference_steps": 2, "num_frames": 9}
    with openai.OpenAI(base_url=f"{sound_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        tracks = []
        for more in ({}, {"audio_guidance_scale": 2.0, "stg_blocks": "[1]"}):
            job = client.videos.create_and_poll(
                prompt=PROMPT,
                size="64x64",
                input_reference=("first.png", picture(64, 64, seed=1), "image/png"),
                poll_interval_ms=20,
                extra_body={**extra, **more},
            )
            assert job.status == "completed", job
            samples, rate, frames = decode_sound(client.videos.download_content(job.id).read())
            assert (rate, frames) == (24000, 9)
            tracks.append(samples)
    assert np.abs(tracks[0] - tracks[1]).mean() > 0.01  # the knobs reach the sound


@pytest.mark.asyncio
async def test_the_native_stream_names_the_sound_track(sound_server):
    body = {"prompt": PROMPT, "width": 64, "height": 64, "num_frames": 9, "num_inference_steps": 2, "seed": 1}
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session,
        session.post(f"{sound_server.base_url}/v1/generations", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        events = [event async for event in sse_events(resp)]
    name, data = events[-1]
    assert name == "completed" and data["video"]["format"] == "mp4" and data["video"]["audio_sample_rate"] == 24000
    samples, rate, frames = decode_sound(base64.b64decode(data["video"]["b64"]))
    assert (rate, frames, samples.shape[0]) == (24000, 9, 2) and np.abs(samples).std() > 0.01
    # A lossless WebP cannot carry sound: the file says it is silent.
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session,
        session.post(f"{sound_server.base_url}/v1/generations", json={**body, "video_format": "webp"}) as resp,
    ):
        events = [event async for event in sse_events(resp)]
    video = events[-1][1]["video"]
    assert video["format"] == "webp" and "audio_sample_rate" not in video


@pytest.mark.parametrize("family", ["hunyuan-video-15", "hunyuan-video-15-i2v"])
def test_hunyuan_video_15_serves_video_jobs(serve, family, request):
    """HunyuanVideo-1.5's checkpoints warm up and serve /v1/videos through the openai client: text to video, and
    image to video sized by its image (a silent clip: the family makes no sound)."""
    fixture = {"hunyuan-video-15": "tiny_hunyuan15", "hunyuan-video-15-i2v": "tiny_hunyuan15_i2v"}[family]
    server = serve(model=request.getfixturevalue(fixture), api_key=API_KEY, max_pixels=80 * 48)
    extra = {"seed": 1, "num_inference_steps": 2, "num_frames": 5}
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        model = client.models.list().data[0]
        assert model.model_extra["diffusiond"]["audio_sample_rate"] is None
        more = {"input_reference": ("first.png", picture(70, 40, seed=1), "image/png")} if "i2v" in family else {}
        job = client.videos.create_and_poll(prompt=PROMPT, poll_interval_ms=20, extra_body=extra, **more)
        assert job.status == "completed", job
        data = client.videos.download_content(job.id).read()
    with av.open(io.BytesIO(data)) as container:
        assert not container.streams.audio
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    assert len(frames) == 5 and frames[0].shape == (48, 80, 3)
