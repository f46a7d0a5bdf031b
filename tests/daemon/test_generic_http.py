"""The generic path through HTTP (models/generic/): Stable Diffusion 1.5 and Stable Audio Open, which no dedicated
family serves, behind a live server: `/v1/models` says "generic" and lists what a request may add; staggered
concurrent requests each equal the pipeline's own call (PNG within 2/255); the native stream shows progress and
previews; a DELETE ends the call at the next step; a higher class overtakes a running call on a one-slot server and
the call resumes to its image; sound comes back as WAV or FLAC."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from sse import sse_events

from diffusiond.daemon.audio_encoding import decode_wav

TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def sd15_server(serve, tiny_sd15):
    return serve(model=tiny_sd15)


@pytest.fixture(scope="module")
def one_slot(serve, tiny_sd15):
    return serve(model=tiny_sd15, max_batch=1)


@pytest.fixture(scope="module")
def sd15(tiny_sd15):
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_sd15)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def expected(pipe, body: dict) -> np.ndarray:
    image = pipe(
        body["prompt"],
        negative_prompt=body.get("negative_prompt"),
        num_inference_steps=body["num_inference_steps"],
        generator=torch.Generator().manual_seed(body["seed"]),
        output_type="np",
    ).images[0]
    return (image * 255).round().astype(np.uint8)


async def stream(session, server, body: dict, on_event=None) -> list[tuple[str, dict]]:
    async with session.post(f"{server.base_url}/v1/generations", json=body) as resp:
        assert resp.status == 200, await resp.text()
        events = []
        async for name, data in sse_events(resp):
            events.append((name, data))
            if on_event is not None:
                await on_event(name, data, resp.headers["X-Request-Id"])
        return events


def png(data: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data["images"][0]["b64"]))).convert("RGB"))


@pytest.mark.asyncio
async def test_models_say_generic_and_list_what_a_request_may_add(sd15_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{sd15_server.base_url}/v1/models") as resp:
            model = (await resp.json())["data"][0]
        caps = model["diffusiond"]
        assert caps["mode"] == "generic" and caps["pipeline"] == "StableDiffusionPipeline"
        assert "eta" in caps["fields"] and "guidance_scale" in caps["fields"]
        body = {"prompt": "x", "seed": 1, "true_cfg_scale": 4.0}
        async with session.post(f"{sd15_server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "true_cfg_scale"
        body = {"prompt": "x", "seed": 1, "arguments": {"wings": 2}}
        async with session.post(f"{sd15_server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "arguments"


@pytest.mark.asyncio
async def test_staggered_concurrent_requests_equal_the_pipeline(sd15_server, sd15):
    """Three native streams started a step apart (mixed prompts, seeds, negative prompts, step counts) and an
    OpenAI request: every image is the pipeline's own call, within PNG rounding."""
    bodies = [
        {"prompt": "a red circle", "seed": 1, "num_inference_steps": 6, "negative_prompt": "blue", "preview_every": 1},
        {"prompt": "a blue square on a green background", "seed": 2, "num_inference_steps": 4, "preview_every": 2},
        {"prompt": "a small white triangle", "seed": 3, "num_inference_steps": 6, "negative_prompt": "a dog"},
    ]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = [asyncio.Event() for _ in bodies]

        async def one(i: int):
            if i:
                await started[i - 1].wait()

            async def mark(name, data, rid):
                if name == "progress":
                    started[i].set()

            return await stream(session, sd15_server, bodies[i], mark)

        streams = await asyncio.gather(*(one(i) for i in range(len(bodies))))
        openai = {"prompt": "a cat", "seed": 4, "num_inference_steps": 4, "size": "64x64"}
        async with session.post(f"{sd15_server.base_url}/v1/images/generations", json=openai) as resp:
            assert resp.status == 200, await resp.text()
            b64 = (await resp.json())["data"][0]["b64_json"]
    for body, events in zip(bodies, streams, strict=True):
        names = [n for n, _ in events]
        assert names[-1] == "completed", names
        progress = [d for n, d in events if n == "progress"]
        assert progress[-1]["step"] == progress[-1]["total"] == body["num_inference_steps"] + 1  # PNDM: N + 1
        if body.get("preview_every"):
            assert any(n == "preview" for n in names)
        diff = np.abs(png(events[-1][1]).astype(int) - expected(sd15, body)).max()
        assert diff <= 2, (body["prompt"], diff)
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))
    assert np.abs(image.astype(int) - expected(sd15, openai)).max() <= 2


@pytest.mark.asyncio
async def test_delete_ends_the_call_at_the_next_step(sd15_server):
    forwards = []
    hook = sd15_server.state.engine.adapter.pipe.unet.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            cancelled_at = {}

            async def cancel(name, data, rid):
                if name == "progress" and data["step"] >= 2 and not cancelled_at:
                    cancelled_at["forwards"] = len(forwards)
                    async with session.delete(f"{sd15_server.base_url}/v1/generations/{rid}") as resp:
                        assert resp.status == 202

            body = {"prompt": "a long one", "seed": 9, "num_inference_steps": 200}
            events = await stream(session, sd15_server, body, cancel)
        assert events[-1][0] == "cancelled", [n for n, _ in events]
        await asyncio.sleep(0.3)
        assert len(forwards) - cancelled_at["forwards"] <= 2  # the step in flight at most, then nothing
    finally:
        hook.remove()
    assert not sd15_server.state.engine.adapter.rows


@pytest.mark.asyncio
async def test_a_higher_class_overtakes_a_running_call(one_slot, sd15):
    """One slot: a class-0 stream runs; a class-9 request arrives, is served first, and the class-0 call resumes to
    the image the pipeline makes."""
    low = {"prompt": "a patient shape", "seed": 7, "num_inference_steps": 30, "priority": 0}
    high = {"prompt": "an urgent shape", "seed": 8, "num_inference_steps": 3, "priority": 9}
    order: list[str] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        urgent: list[asyncio.Task] = []

        async def send_high(name, data, rid):
            if name == "progress" and data["step"] >= 3 and not urgent:

                async def run():
                    events = await stream(session, one_slot, high)
                    order.append("high")
                    return events

                urgent.append(asyncio.ensure_future(run()))

        events = await stream(session, one_slot, low, send_high)
        order.append("low")
        high_events = await urgent[0]
    assert order == ["high", "low"], order
    names = [n for n, _ in events]
    assert "paused" in names and "resumed" in names, names
    assert high_events[-1][0] == "completed"
    assert np.abs(png(events[-1][1]).astype(int) - expected(sd15, low)).max() <= 2


@pytest.mark.asyncio
async def test_sound_comes_back_as_wav_or_flac(serve, tiny_stable_audio):
    server = serve(model=tiny_stable_audio, adapter="generic")  # the dedicated family's: test_stable_audio.py
    assert server.state.engine.adapter.capabilities.mode == "generic"
    pipe = diffusers.StableAudioPipeline.from_pretrained(tiny_stable_audio)
    pipe.set_progress_bar_config(disable=True)
    body = {"prompt": "a dog barking", "seed": 5, "num_inference_steps": 3}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        events = await stream(session, server, body)
        flac = await stream(session, server, {**body, "audio_format": "flac"})
        by_url = await stream(session, server, {**body, "response_format": "url"})
        async with session.get(by_url[-1][1]["audio"]["url"]) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "audio/wav"
            kept = await resp.read()
        async with session.post(f"{server.base_url}/v1/generations", json={**body, "video_format": "mp4"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "video_format"
    name, data = events[-1]
    assert name == "completed" and data["audio"]["format"] == "wav", data
    sound = decode_wav(base64.b64decode(data["audio"]["b64"]))
    reference = pipe(
        body["prompt"], num_inference_steps=3, generator=torch.Generator().manual_seed(5), output_type="np"
    ).audios[0]
    assert sound.sample_rate == data["audio"]["sample_rate"] and sound.samples.shape == reference.shape
    assert float(np.abs(sound.samples - np.clip(reference, -1, 1)).max()) <= 2 / 32767
    assert flac[-1][1]["audio"]["format"] == "flac" and base64.b64decode(flac[-1][1]["audio"]["b64"])[:4] == b"fLaC"
    assert kept == base64.b64decode(data["audio"]["b64"])  # a file served by its signed URL (it was a 500)


@pytest.mark.asyncio
async def test_a_wan_layout_the_family_does_not_read_serves_image_to_video_jobs(
    serve, tiny_wan_i2v_no_image_projections
):
    """Wan I2V with an image embedding and no image key/value projections goes generic at load (it killed the daemon
    at warm-up before) and serves /v1/videos jobs from a first frame: the MP4 holds the pipeline's own clip, frame by
    frame within what H.264 changes (as tests/daemon/test_videos.py reads MP4s), and the native stream's lossless
    WebP the exact frames (within 2/255)."""
    from pictures import picture
    from videos import decode_mp4, decode_webp

    model = tiny_wan_i2v_no_image_projections
    server = serve(model=model, max_pixels=64 * 64)
    assert server.state.engine.adapter.capabilities.mode == "generic"
    first = picture(48, 32, seed=2)
    clip = {"prompt": "a red ball rolling on grass", "num_frames": 5, "num_inference_steps": 2, "seed": 6}
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=Image.open(io.BytesIO(first)).convert("RGB"), prompt=clip["prompt"], num_frames=5, height=32, width=48,
        num_inference_steps=2, generator=torch.Generator().manual_seed(6), output_type="np",
    ).frames[0]  # fmt: skip
    expected = (expected * 255).round()
    data_url = "data:image/png;base64," + base64.b64encode(first).decode()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        body = {**clip, "size": "48x32", "input_reference": {"image_url": data_url}}
        async with session.post(f"{server.base_url}/v1/videos", json=body) as resp:
            assert resp.status == 200, await resp.text()
            job = await resp.json()
        for _ in range(600):
            async with session.get(f"{server.base_url}/v1/videos/{job['id']}") as resp:
                job = await resp.json()
            if job["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.05)
        assert job["status"] == "completed", job
        async with session.get(f"{server.base_url}/v1/videos/{job['id']}/content") as resp:
            mp4 = decode_mp4(await resp.read()).astype(float)
        native = {**clip, "width": 48, "height": 32, "image": base64.b64encode(first).decode(), "video_format": "webp"}
        events = await stream(session, server, native)
    webp = decode_webp(base64.b64decode(events[-1][1]["video"]["b64"])).astype(float)
    assert webp.shape == expected.shape and np.abs(webp - expected).max() <= 2

    def pooled(frames):  # 4x4 blocks: H.264's colour subsampling averaged out (FACTS.md)
        f, h, w, c = frames.shape
        return frames.reshape(f, h // 4, 4, w // 4, 4, c).mean(axis=(2, 4))

    for i, frame in enumerate(pooled(mp4)):
        errors = [np.abs(frame - e).mean() for e in pooled(expected)]
        assert int(np.argmin(errors)) == i and errors[i] < 6.0, (i, errors)


@pytest.mark.asyncio
async def test_a_modular_pipeline_serves_through_its_denoise_loop(serve, tiny_flux_modular):
    """`FluxModularPipeline` (modular_model_index.json) behind the server: two concurrent streams, each the Modular
    pipeline's own call (within PNG rounding), with progress from its loop's steps."""
    from diffusers.modular_pipelines import ModularPipeline

    server = serve(model=tiny_flux_modular, max_pixels=64 * 64)
    pipe = ModularPipeline.from_pretrained(tiny_flux_modular)
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    bodies = [
        {"prompt": f"a shape {s}", "seed": s, "num_inference_steps": 3, "width": 64, "height": 64} for s in (1, 2)
    ]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        streams = await asyncio.gather(*(stream(session, server, body) for body in bodies))
    for body, events in zip(bodies, streams, strict=True):
        assert [n for n, _ in events][-1] == "completed"
        assert max(d["step"] for n, d in events if n == "progress") == 3
        expected = pipe(
            prompt=body["prompt"], height=64, width=64, num_inference_steps=3,
            generator=torch.Generator().manual_seed(body["seed"]), output="images", output_type="np",
        )[0]  # fmt: skip
        assert np.abs(png(events[-1][1]).astype(int) - (expected * 255).round()).max() <= 2
