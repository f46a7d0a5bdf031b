"""Video over HTTP, on the tiny Wan 2.1 checkpoints: OpenAI's Videos API (`/v1/videos`, with the official `openai`
client: create, poll, download, list, delete), the job's progress, cancelling a running job, the store's limits on a
live server, the native stream's video fields, and the errors of both APIs."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import av
import numpy as np
import openai
import pytest
from conftest import API_KEY, ServerThread
from needs import missing
from pictures import picture
from PIL import Image
from sse import sse_events

from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.video_store import MIN_FREE_BYTES, SIDECAR_BYTES
from diffusiond.daemon.videos_api import VIDEOS

# OpenAI's client marks its Videos API deprecated (the Sora API's shutdown), which this suite's `error` filter would
# turn into failures.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = aiohttp.ClientTimeout(total=60)
PROMPT = "a red ball rolling on grass"
SIZE = "48x32"
# 1 second at the model's 16 fps: the shortest 1 + 4k clip that lasts that long has 17 frames (1.0625 s).
SECONDS, FRAMES, FPS = "1", 17, 16
LONG_STEPS = 1000


@pytest.fixture(scope="module")
def video_server(serve, tiny_wan):
    # max_pixels keeps the warm-up at the smallest size (the model's default, 512x288 with 81 frames, takes 20 s on
    # CPU); every request here is at most 64x64.
    return serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64)


@pytest.fixture(scope="module")
def client(video_server):
    with openai.OpenAI(base_url=f"{video_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def decode_video(data: bytes) -> tuple[list[np.ndarray], float]:
    """The frames ([H, W, 3] uint8) of an MP4 and its frame rate."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return frames, float(stream.average_rate)


def decode_webp(data: bytes) -> list[np.ndarray]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "WEBP"
        frames = []
        for i in range(image.n_frames):
            image.seek(i)
            frames.append(np.asarray(image.convert("RGB")))
        return frames


def video_files(server, job_id: str) -> list[str]:
    directory = server.app[VIDEOS].store.directory
    return [name for name in os.listdir(directory) if name.startswith(job_id)]


async def native(server, body: dict) -> list[tuple[str, dict]]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session,
        session.post(f"{server.base_url}/v1/generations", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return [event async for event in sse_events(resp)]


async def create(session, server, **body) -> dict:
    async with session.post(f"{server.base_url}/v1/videos", json={"prompt": PROMPT, **body}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def retrieve(session, server, job_id: str) -> tuple[int, dict]:
    async with session.get(f"{server.base_url}/v1/videos/{job_id}") as resp:
        return resp.status, await resp.json()


async def wait_for(session, server, job_id: str, status: str, within: float = 30.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        code, job = await retrieve(session, server, job_id)
        assert code == 200, job
        if job["status"] == status:
            return job
        assert time.monotonic() < deadline, f"{job_id} did not reach {status} within {within}s: {job}"
        await asyncio.sleep(0.02)


# ---- OpenAI's client ----


def test_openai_client_creates_polls_downloads_and_deletes(video_server, client):
    model = client.models.list().data[0].id
    job = client.videos.create_and_poll(
        model=model,
        prompt=PROMPT,
        seconds=SECONDS,
        size=SIZE,
        poll_interval_ms=20,
        extra_body={"seed": 3, "num_inference_steps": 4},
    )
    assert job.object == "video" and job.id.startswith("video_")
    assert (job.status, job.progress, job.model, job.prompt, job.size) == ("completed", 100, model, PROMPT, SIZE)
    assert job.seconds == "1" and job.error is None  # what it asked; its 17 frames play 1.0625 s
    assert job.completed_at >= job.created_at and job.expires_at == job.completed_at + 3600
    extra = job.model_extra
    assert (extra["num_frames"], extra["fps"], extra["seed"], extra["format"]) == (FRAMES, FPS, 3, "mp4")
    assert client.videos.retrieve(job.id) == job

    content = client.videos.download_content(job.id)
    assert content.response.headers["content-type"] == "video/mp4"
    frames, fps = decode_video(content.read())
    assert len(frames) == FRAMES and frames[0].shape == (32, 48, 3) and fps == FPS
    assert np.stack(frames).std() > 5  # a picture, not a flat fill

    listed = client.videos.list(limit=100)
    assert job.id in [v.id for v in listed.data]
    assert video_files(video_server, job.id)

    deleted = client.videos.delete(job.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (job.id, True, "video.deleted")
    assert video_files(video_server, job.id) == []
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(job.id)


def test_a_two_expert_checkpoint_serves_video_jobs(serve, tiny_wan22):
    """Wan 2.2 A14B's layout starts (LoRA per expert; /v1/models says so), warms up, and runs jobs through the
    openai SDK; `guidance_scale_2` reaches the low-noise expert."""
    server = serve(model=tiny_wan22)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0]
        assert model.model_extra["diffusiond"]["lora"] is True  # per expert (tests/models/test_wan22_lora.py)
        clips = []
        for extra in ({}, {"guidance_scale_2": 9.0}):
            job = client.videos.create_and_poll(
                model=model.id,
                prompt=PROMPT,
                size=SIZE,
                poll_interval_ms=20,
                extra_body={"seed": 3, "num_inference_steps": 4, "num_frames": 5, **extra},
            )
            assert job.status == "completed", job
            frames, _ = decode_video(client.videos.download_content(job.id).read())
            clips.append(np.stack(frames).astype(int))
    assert clips[0].shape == (5, 32, 48, 3)
    assert np.abs(clips[0] - clips[1]).mean() > 1  # the second expert's guidance changed the clip


def test_openai_client_lists_pages_in_either_order(video_server, client):
    ids = [
        client.videos.create(prompt=PROMPT, size=SIZE, extra_body={"num_frames": 5, "num_inference_steps": 1}).id
        for _ in range(3)
    ]
    first = client.videos.list(limit=2, order="asc")
    mine = [v.id for v in first.data]
    # Earlier tests' jobs come first in ascending order: page through everything.
    everything = [v.id for v in client.videos.list(limit=2, order="asc")]  # the client follows `last_id` pages
    assert everything[-3:] == ids and mine == everything[:2] and first.has_more
    newest = client.videos.list(limit=2, order="desc")
    assert [v.id for v in newest.data] == ids[::-1][:2] and newest.last_id == ids[1]
    after = client.videos.list(limit=5, order="desc", after=ids[1])
    assert [v.id for v in after.data][:1] == [ids[0]]
    for job_id in ids:
        client.videos.delete(job_id)


def test_input_reference_to_a_text_only_model_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt=PROMPT, size=SIZE, input_reference=("first.png", picture(48, 32), "image/png"))
    assert info.value.body["param"] == "input_reference"


def test_input_reference_starts_an_image_to_video_job(serve, tiny_wan_i2v):
    server = serve(model=tiny_wan_i2v, api_key=API_KEY, max_pixels=64 * 64)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.videos.create(prompt=PROMPT, size=SIZE)  # no first frame
        assert info.value.body["param"] == "input_reference"
        extra = {"seed": 1, "num_inference_steps": 2, "num_frames": 5}
        first = ("first.png", picture(48, 32, seed=1), "image/png")
        job = client.videos.create_and_poll(
            prompt=PROMPT, size=SIZE, input_reference=first, poll_interval_ms=20, extra_body=extra
        )
        assert job.status == "completed", job
        frames, _ = decode_video(client.videos.download_content(job.id).read())
        assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
        # The same request as JSON, with the image as a data URL: the same clip.
        data_url = "data:image/png;base64," + base64.b64encode(picture(48, 32, seed=1)).decode()
        again = client.post(
            "/videos",
            body={"prompt": PROMPT, "size": SIZE, "input_reference": {"image_url": data_url}, **extra},
            cast_to=openai.types.Video,
        )
        again = client.videos.poll(again.id, poll_interval_ms=20)
        same, _ = decode_video(client.videos.download_content(again.id).read())
        np.testing.assert_array_equal(np.stack(same), np.stack(frames))
        with pytest.raises(openai.BadRequestError) as info:
            client.post(
                "/videos",
                body={"prompt": PROMPT, "input_reference": {"image_url": "https://example.com/a.png"}},
                cast_to=openai.types.Video,
            )
        assert info.value.body["param"] == "input_reference" and "data URL" in info.value.body["message"]


def test_one_ti2v_checkpoint_makes_videos_from_text_and_from_an_image(serve, tiny_wan22_ti2v):
    """Wan 2.2 TI2V-5B: the same server answers a text-only job and one with input_reference; 24 fps by default."""
    server = serve(model=tiny_wan22_ti2v)
    first = picture(96, 64, seed=5)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        extra = {"seed": 1, "num_inference_steps": 3, "num_frames": 5}
        clips = []
        for reference in (None, ("first.png", first, "image/png")):
            more = {"input_reference": reference} if reference else {}
            job = client.videos.create_and_poll(
                prompt=PROMPT, size="96x64", poll_interval_ms=20, extra_body=extra, **more
            )
            assert job.status == "completed" and job.model_extra["fps"] == 24, job
            frames, _ = decode_video(client.videos.download_content(job.id).read())
            clips.append(np.stack(frames).astype(int))
    # The image reached the model (the tiny random VAE does not reconstruct it, so no closeness to check here; the
    # pixels equal WanImageToVideoPipeline's in tests/models/test_wan.py).
    assert clips[0].shape == clips[1].shape == (5, 64, 96, 3)
    assert np.abs(clips[0] - clips[1]).mean() > 1


# ---- progress and cancellation ----


@pytest.mark.asyncio
async def test_progress_rises_to_100(video_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        job = await create(session, video_server, size=SIZE, num_frames=9, num_inference_steps=300, seed=1)
        seen = [(job["status"], job["progress"])]
        while seen[-1][0] not in ("completed", "failed", "cancelled"):
            code, job = await retrieve(session, video_server, job["id"])
            assert code == 200
            seen.append((job["status"], job["progress"]))
            await asyncio.sleep(0.005)
    progress = [p for _, p in seen]
    statuses = [s for s, _ in seen]
    assert statuses[-1] == "completed" and progress[-1] == 100, seen
    assert progress == sorted(progress), seen
    assert any(0 < p < 100 for p in progress), seen
    # queued, then in_progress, then completed: never back.
    order = {"queued": 0, "in_progress": 1, "completed": 2}
    assert [order[s] for s in statuses] == sorted(order[s] for s in statuses), seen


@pytest.mark.asyncio
async def test_deleting_a_running_job_cancels_it_and_leaves_no_file(video_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        job = await create(session, video_server, size="64x64", num_frames=17, num_inference_steps=LONG_STEPS)
        rid = job["id"].removeprefix("video_")
        deadline = time.monotonic() + 30
        while job["progress"] < 2:  # 2% of 1000 steps: a few dozen steps in
            assert time.monotonic() < deadline, job
            code, job = await retrieve(session, video_server, job["id"])
            assert code == 200 and job["status"] in ("queued", "in_progress"), job
        async with session.get(f"{video_server.base_url}/v1/videos/{job['id']}/content") as resp:
            assert resp.status == 409 and (await resp.json())["error"]["code"] == "video_not_ready"
        async with session.delete(f"{video_server.base_url}/v1/videos/{job['id']}") as resp:
            assert resp.status == 200
            assert await resp.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        # DELETE answered once the engine request had stopped, at a step boundary well before the end.
        record = video_server.record(rid)
        assert record["status"] == "cancelled" and 0 < record["step"] < LONG_STEPS, record
        code, body = await retrieve(session, video_server, job["id"])
        assert code == 404 and body["error"]["param"] == "video_id"
        async with session.delete(f"{video_server.base_url}/v1/videos/{job['id']}") as resp:
            assert resp.status == 404
    assert video_files(video_server, job["id"]) == []
    await asyncio.to_thread(video_server.wait_idle)
    assert job["id"] not in video_server.app[VIDEOS].tasks


# ---- the store's limits, live ----


@pytest.mark.asyncio
async def test_byte_budget_evicts_the_oldest_finished_video_never_a_running_one(serve, tiny_wan, tmp_path_factory):
    clip = {"size": SIZE, "num_frames": 9, "num_inference_steps": 2, "seed": 7}
    probe = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64)
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        size = await wait_for(session, probe, (await create(session, probe, **clip))["id"], "completed")
        size = probe.app[VIDEOS].store.jobs[size["id"]].bytes
        # Room for one of these videos and a half, each with its JSON file: each new one evicts the one before.
        folder = tmp_path_factory.mktemp("videos")
        budget = (size + SIDECAR_BYTES) * 3 // 2
        server = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64, video_store_bytes=budget,
                       video_dir=str(folder))  # fmt: skip
        running = await create(session, server, size="64x64", num_frames=17, num_inference_steps=LONG_STEPS)
        first = await wait_for(session, server, (await create(session, server, **clip))["id"], "completed")
        assert sorted(os.listdir(folder)) == sorted(f"{first['id']}.{ext}" for ext in ("mp4", "json"))
        second = await wait_for(session, server, (await create(session, server, **clip))["id"], "completed")
        assert (await retrieve(session, server, first["id"]))[0] == 404
        assert sorted(os.listdir(folder)) == sorted(f"{second['id']}.{ext}" for ext in ("mp4", "json"))
        code, still = await retrieve(session, server, running["id"])
        assert code == 200 and still["status"] in ("queued", "in_progress"), still
        # Served whole: the bytes its job recorded (not the probe's: the probe's server is shared with other tests,
        # and a request still ending there can share the probe clip's forwards and change its H.264 bytes).
        stored = server.app[VIDEOS].store.jobs[second["id"]].bytes
        assert size // 2 < stored <= size * 3 // 2 + SIDECAR_BYTES
        async with session.get(f"{server.base_url}/v1/videos/{second['id']}/content") as resp:
            assert resp.status == 200 and len(await resp.read()) == stored
        async with session.delete(f"{server.base_url}/v1/videos/{running['id']}") as resp:
            assert resp.status == 200


@pytest.mark.asyncio
async def test_finished_videos_expire(serve, tiny_wan):
    server = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64, video_ttl=1, max_batch=1, max_queue=0)
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        job = await create(session, server, size=SIZE, num_frames=5, num_inference_steps=1)
        job = await wait_for(session, server, job["id"], "completed")
        assert job["expires_at"] == job["completed_at"] + 1
        # The periodic sweep removes the file, without anyone asking for the job.
        deadline = time.monotonic() + 10
        while video_files(server, job["id"]):
            assert time.monotonic() < deadline, "the expired video's file is still there"
            await asyncio.sleep(0.05)
        assert (await retrieve(session, server, job["id"]))[0] == 404


@pytest.mark.asyncio
async def test_a_full_queue_answers_429(serve, tiny_wan):
    server = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64, video_ttl=1, max_batch=1, max_queue=0)
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        running = await create(session, server, size=SIZE, num_frames=5, num_inference_steps=LONG_STEPS)
        async with session.post(f"{server.base_url}/v1/videos", json={"prompt": PROMPT, "size": SIZE}) as resp:
            assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
        async with session.delete(f"{server.base_url}/v1/videos/{running['id']}") as resp:
            assert resp.status == 200
        await asyncio.to_thread(server.wait_idle)
        job = await create(session, server, size=SIZE, num_frames=5, num_inference_steps=1)
        await wait_for(session, server, job["id"], "completed")


def test_shutdown_cancels_running_jobs_and_removes_the_temporary_folder(tiny_wan):
    thread = ServerThread(ServeConfig(port=0, model=tiny_wan, max_pixels=64 * 64, max_steps=LONG_STEPS), tiny_wan)
    server = thread.start()
    try:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            extra = {"num_frames": 5, "num_inference_steps": LONG_STEPS}
            job_id = client.videos.create(prompt=PROMPT, size=SIZE, extra_body=extra).id
            server.wait_until(lambda: client.videos.retrieve(job_id).progress > 0, what="the job to start")
        store = server.app[VIDEOS].store
        job = server.call(lambda: store.jobs[job_id])
        assert store.directory.is_dir()
    finally:
        thread.stop()
    assert job.status == "cancelled" and job.error["code"] == "cancelled", job
    assert server.state.records[job.request_id].status == "cancelled"
    assert not store.directory.exists()


# ---- the native stream ----


@pytest.mark.asyncio
async def test_native_stream_sends_strip_previews_and_the_video(video_server):
    body = {"prompt": PROMPT, "width": 48, "height": 32, "num_frames": 9, "fps": 8, "num_inference_steps": 6,
            "preview_every": 2, "seed": 5}  # fmt: skip
    events = await native(video_server, body)
    names = [name for name, _ in events]
    assert names[0] == "queued" and names[-1] == "completed" and names.count("preview") >= 2, names
    for name, data in events:
        if name == "preview":
            with Image.open(io.BytesIO(base64.b64decode(data["b64"]))) as strip:
                # The 3 latent frames of 9 (1 + 4k) side by side, each in the clip's 3:2 aspect.
                assert strip.size == (data["width"], data["height"]) == (3 * data["height"] * 3 // 2, data["height"])
    done = events[-1][1]
    assert "images" not in done and done["seed"] == 5
    video = done["video"]
    assert {k: video[k] for k in ("format", "fps", "num_frames", "width", "height")} == {
        "format": "mp4", "fps": 8, "num_frames": 9, "width": 48, "height": 32
    }  # fmt: skip
    frames, fps = decode_video(base64.b64decode(video["b64"]))
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3) and fps == 8


@pytest.mark.asyncio
async def test_the_mp4_holds_the_frames_the_model_made(video_server):
    """The native stream's lossless WebP has the engine's exact frames; the MP4 of /v1/videos for the same request
    holds them, in order (within what H.264 changes), and not those of another seed. (The tiny model's seeds differ
    by about 4/255 on average, H.264 changes about as much: a seed's clip is told apart by where the MP4 departs
    from the other seed's, not by the size of the error.)"""
    clip = {"prompt": PROMPT, "num_frames": 9, "num_inference_steps": 4}
    exact = {}
    for seed in (11, 12):
        events = await native(video_server, {**clip, "width": 48, "height": 32, "seed": seed, "video_format": "webp"})
        video = events[-1][1]["video"]
        assert video["format"] == "webp" and "format_fallback" not in video
        exact[seed] = np.stack(decode_webp(base64.b64decode(video["b64"]))).astype(float)
        assert len(exact[seed]) == 9
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        job = await create(session, video_server, **clip, size=SIZE, seed=11)
        await wait_for(session, video_server, job["id"], "completed")
        async with session.get(f"{video_server.base_url}/v1/videos/{job['id']}/content") as resp:
            assert resp.status == 200 and resp.content_type == "video/mp4"
            frames, _ = decode_video(await resp.read())
    mp4, ours, other = np.stack(frames).astype(float), exact[11], exact[12]
    for i, frame in enumerate(mp4):
        errors = [np.abs(frame - f).mean() for f in ours]
        assert int(np.argmin(errors)) == i and errors[i] < 6.0, (i, errors)
    toward_ours = np.corrcoef((mp4 - other).ravel(), (ours - other).ravel())[0, 1]
    toward_other = np.corrcoef((mp4 - ours).ravel(), (other - ours).ravel())[0, 1]
    assert toward_ours > 0.45 > toward_other, (toward_ours, toward_other)


# ---- errors ----


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seconds": "abc"}, "seconds"),
        ({"seconds": "0"}, "seconds"),
        ({"seconds": -1}, "seconds"),
        ({"seconds": "100"}, "seconds"),  # 1601 frames at 16 fps; the tiny model makes at most 125
        ({"seconds": "1", "num_frames": 17}, "seconds"),
        ({"num_frames": 10}, "num_frames"),  # not 1 + 4k
        ({"fps": 0}, "fps"),
        ({"size": "47x32"}, "size"),  # sides are multiples of 16
        ({"size": "big"}, "size"),
        ({"size": "128x128"}, "size"),  # above --max-pixels
        ({"model": "sora-2"}, "model"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"input_reference": {"file_id": "file_1"}}, "input_reference"),
        ({"true_cfg_scale": 2.5}, "true_cfg_scale"),  # Wan guides by guidance_scale: a knob it would ignore
        ({"cache_threshold": 0.2}, "cache_threshold"),  # served without --cache
        ({"cache_steps": "fast"}, "cache_steps"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2"),  # one denoiser: no low-noise expert to guide
    ],
)
async def test_bad_video_requests_are_400s_naming_the_field(video_server, body, param):
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session,
        session.post(f"{video_server.base_url}/v1/videos", json={"prompt": PROMPT, "size": SIZE, **body}) as resp,
    ):
        error = (await resp.json())["error"]
    assert resp.status == (404 if param == "model" else 400), error
    assert error["param"] == param, error


@pytest.mark.asyncio
async def test_a_url_encoded_form_is_refused(video_server):
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session,
        session.post(f"{video_server.base_url}/v1/videos", data={"prompt": PROMPT, "size": SIZE}) as resp,
    ):
        error = (await resp.json())["error"]
    assert resp.status == 415 and error["code"] == "unsupported_media_type" and "multipart" in error["message"]


@pytest.mark.asyncio
async def test_a_form_takes_cache_steps_as_a_preset_or_a_json_list(video_server):
    """Multipart bodies carry every field as text: cache_steps is a preset's name or JSON text of a list. This server
    runs without --cache, so a mask that parsed is refused for that (naming the field), one that did not for its
    form."""
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        for value, says in [("fast", "without step caching"), ("[0, 3]", "without step caching"), ("[0,", "JSON")]:
            form = aiohttp.FormData(default_to_multipart=True)  # (as OpenAI's clients send it)
            form.add_field("prompt", PROMPT)
            form.add_field("size", SIZE)
            form.add_field("cache_steps", value)
            async with session.post(f"{video_server.base_url}/v1/videos", data=form) as resp:
                error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == "cache_steps" and says in error["message"], (value, error)


@pytest.mark.asyncio
async def test_a_video_model_refuses_the_images_api(video_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        async with session.post(f"{video_server.base_url}/v1/images/generations", json={"prompt": PROMPT}) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and "/v1/videos" in error["message"] and error["param"] == "model", error
        form = aiohttp.FormData()
        form.add_field("prompt", PROMPT)
        form.add_field("image", picture(48, 32), filename="a.png", content_type="image/png")
        async with session.post(f"{video_server.base_url}/v1/images/edits", data=form) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and "/v1/videos" in error["message"], error


@pytest.mark.asyncio
async def test_an_image_model_refuses_video_fields(server):
    base = {"prompt": PROMPT, "width": 64, "height": 64, "num_inference_steps": 1}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        refused = (({"num_frames": 9}, "num_frames"), ({"fps": 8}, "fps"), ({"video_format": "mp4"}, "video_format"))
        for extra, param in refused:
            async with session.post(f"{server.base_url}/v1/generations", json={**base, **extra}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == param, error
        async with session.post(f"{server.base_url}/v1/videos", json={"prompt": PROMPT}) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == "model" and "images" in error["message"], error


@pytest.mark.asyncio
async def test_video_routes_need_the_api_key(video_server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for method, path in (("POST", ""), ("GET", ""), ("GET", "/x"), ("GET", "/x/content"), ("DELETE", "/x")):
            async with session.request(method, f"{video_server.base_url}/v1/videos{path}", json={"prompt": "p"}) as r:
                assert r.status == 401, (method, path)


@pytest.mark.asyncio
async def test_unknown_jobs_and_bad_list_queries(video_server):
    base = f"{video_server.base_url}/v1/videos"
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        for path in ("/video_nope", "/video_nope/content"):
            async with session.get(base + path) as resp:
                assert resp.status == 404
        bad = (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=nope", "after"))
        for query, param in bad:
            async with session.get(f"{base}?{query}") as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == param


# ---- README ----


def readme_video_blocks() -> list[str]:
    """The bash blocks of README's Video section that drive a video model, as text."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Video\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return [block for block in blocks if block.startswith("# needs: a video model")]


def for_the_tiny_model(text: str, server) -> str:
    """README's commands, pointed at the test server (which wants its key) at a size the tiny model serves fast."""
    text = text.replace("localhost:8000", f"127.0.0.1:{server.port}")
    text = text.replace('api_key="unused"', f'api_key="{API_KEY}"')
    text = text.replace("curl -s", f"curl -H 'Authorization: Bearer {API_KEY}' -s")
    return text.replace("832x480", SIZE).replace('"width": 832, "height": 480', '"width": 48, "height": 32')


def test_readme_video_examples(video_server, tmp_path):
    curls, python = readme_video_blocks()
    commands = [line for line in for_the_tiny_model(curls, video_server).splitlines() if line.startswith("curl")]
    create, status, content, stream = commands

    def run(command: str) -> str:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, timeout=120, check=False)
        assert result.returncode == 0, (command, result.stderr)
        return result.stdout.decode()

    job = json.loads(run(create))
    assert job["status"] == "queued" and job["num_frames"] == 65 and job["seconds"] == "4", job
    video_server.wait_until(
        lambda: json.loads(run(status.replace("VIDEO_ID", job["id"])))["status"] == "completed", 60, "the job"
    )
    run(content.replace("VIDEO_ID", job["id"]))
    frames, fps = decode_video((tmp_path / "clip.mp4").read_bytes())
    assert len(frames) == 65 and frames[0].shape == (32, 48, 3) and fps == 16
    out = run(stream)
    assert "event: preview" in out and "event: completed" in out and '"video":' in out, out[-300:]

    (tmp_path / "clip.mp4").unlink()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(
        ["bash", "-c", for_the_tiny_model(python, video_server)], cwd=tmp_path, env=env, capture_output=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().split() == ["completed", "4", "65"]
    frames, fps = decode_video((tmp_path / "clip.mp4").read_bytes())
    assert len(frames) == 65 and fps == 16


def test_warm_up_and_limits_of_a_video_model(tiny_wan):
    """The warm-up runs the default size in the shortest clip past one frame (not the default 81 frames), and
    `--max-frames` (default: the most the model makes) refuses longer clips naming num_frames."""
    from diffusiond.daemon.app import request_limits, warm_up_params
    from diffusiond.models.loading.loader import load_adapter
    from diffusiond.models.params import SamplingParams

    caps = load_adapter(tiny_wan).capabilities
    warm = warm_up_params(caps)
    assert (warm.width, warm.height, warm.num_frames) == (caps.default_width, caps.default_height, 5)
    assert request_limits(ServeConfig(), caps).max_frames == caps.max_num_frames
    limits = request_limits(ServeConfig(max_frames=9), caps)
    clip = SamplingParams(prompt="a cat", width=48, height=32, num_frames=13, num_inference_steps=2)
    assert limits.check(clip)[0] == "num_frames"
    assert limits.check(SamplingParams(prompt="a cat", width=48, height=32, num_frames=9)) is None


def test_generate_writes_a_clip(tiny_wan, tiny_sd3, tmp_path, capsys):
    """`diffusiond generate` on a video model writes an MP4 of the asked frames and fps; an image model refuses
    --num-frames naming the flag."""
    from diffusiond.daemon import cli

    out = tmp_path / "clip.mp4"
    args = ["generate", "a red cat", "--model", tiny_wan, "--size", "48x32", "--steps", "2", "--seed", "1"]
    code = cli.main([*args, "--num-frames", "9", "--fps", "8", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "9 frames at 8 fps" in captured.out
    frames, fps = decode_video(out.read_bytes())
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3) and fps == 8
    code = cli.main(["generate", "a red circle", "--model", tiny_sd3, "--num-frames", "9", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--num-frames" in err and "Traceback" not in err, err


@pytest.fixture
def tmpfs(tmp_path):
    """A 50 MiB tmpfs (needs CAP_SYS_ADMIN: CI runs as root)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        missing(f"needs a tmpfs mount (root): {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.asyncio
async def test_a_store_on_a_full_disk_refuses_clearly_and_recovers(serve, tiny_wan, tmpfs):
    """The store on a 50 MiB tmpfs, filled to the brim: new jobs are refused (507), a job whose video finds no room
    fails (`storage_full`) and leaves no file; with room again, jobs complete. Broken on purpose (no free-space
    check): the write hit ENOSPC and left its temporary file behind."""
    server = serve(model=tiny_wan, api_key=API_KEY, max_pixels=64 * 64, video_dir=str(tmpfs / "videos"))
    clip = {"size": SIZE, "num_frames": 9, "num_inference_steps": 2, "seed": 7}
    filler = tmpfs / "filler"

    def fill(leave: int) -> None:
        free = shutil.disk_usage(tmpfs).free + (filler.stat().st_size if filler.exists() else 0)
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, free - leave))

    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as session:
        fill(0)  # to the brim
        async with session.post(f"{server.base_url}/v1/videos", json={"prompt": PROMPT, **clip}) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 507 and error["code"] == "insufficient_storage", error
        # Room to take a job, and the disk full again before its video is written.
        fill(MIN_FREE_BYTES + (1 << 20))
        job = await create(session, server, **{**clip, "num_inference_steps": 200})
        fill(0)
        failed = await wait_for(session, server, job["id"], "failed", within=60)
        assert failed["error"]["code"] == "storage_full", failed
        ours = [name for name in os.listdir(tmpfs / "videos") if name != "filler"]
        assert ours == [], ours  # no temporary file, no half video
        async with session.delete(f"{server.base_url}/v1/videos/{job['id']}") as resp:
            assert resp.status == 200
        filler.unlink()
        done = await wait_for(session, server, (await create(session, server, **clip))["id"], "completed")
        assert sorted(os.listdir(tmpfs / "videos")) == sorted(f"{done['id']}.{ext}" for ext in ("mp4", "json"))
        async with session.get(f"{server.base_url}/v1/videos/{done['id']}/content") as resp:
            assert resp.status == 200 and len(await resp.read()) > 0


@pytest.mark.asyncio
async def test_a_job_without_seconds_is_openai_s_four_and_says_what_was_asked(video_server):
    """OpenAI's default length where no `seconds` is sent (issue 54): 4 s at the tiny model's 16 fps is 65 frames
    (the shortest 1 + 4k clip that long); the job says "4", the seconds asked, beside its real frame count (it said
    "5.0625", its 81 default frames, before). Sent seconds come back as sent."""
    async with aiohttp.ClientSession(headers=AUTH) as session:
        job = await create(session, video_server, size=SIZE, num_inference_steps=2)
        assert (job["seconds"], job["num_frames"]) == ("4", 65), job
        job = await create(session, video_server, size=SIZE, num_inference_steps=2, seconds="2")
        assert (job["seconds"], job["num_frames"]) == ("2", 33), job
        job = await create(session, video_server, size=SIZE, num_inference_steps=2, num_frames=9)
        assert (job["seconds"], job["num_frames"]) == ("0.5625", 9), job
