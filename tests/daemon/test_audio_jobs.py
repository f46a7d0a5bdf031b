"""A sound model's jobs (`/v1/audio/generations`, daemon/audio_jobs.py) on tiny Stable Audio Open (its family): a job's
WAV or FLAC file holds the pipeline's own waveform (within 2/32767), its `seconds` the call's length
argument (`audio_end_in_s`) and then the file's real length; jobs of the two kinds are listed and found under their
own prefix only; a DELETE stops a running job at its next step; a job left running at a shutdown runs again at the
next start on the same `--state-dir` and completes with the sound an uninterrupted run makes; a model of another
kind refuses the route, naming the right one."""

from __future__ import annotations

import asyncio
import io

import aiohttp
import av
import diffusers
import numpy as np
import pytest
import torch
from conftest import ServerThread

from diffusiond.daemon.audio_encoding import decode_wav
from diffusiond.daemon.config import ServeConfig

TIMEOUT = aiohttp.ClientTimeout(total=120)
ROUTE = "/v1/audio/generations"


@pytest.fixture(scope="module")
def stable_audio(tiny_stable_audio):
    pipe = diffusers.StableAudioPipeline.from_pretrained(tiny_stable_audio)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def expected(pipe, body: dict) -> np.ndarray:
    length = {"audio_end_in_s": body["seconds"]} if "seconds" in body else {}
    wave = pipe(
        body["prompt"], negative_prompt=body.get("negative_prompt"), num_inference_steps=body["num_inference_steps"],
        generator=torch.Generator().manual_seed(body["seed"]), output_type="np", **length,
    ).audios[0]  # fmt: skip
    return np.clip(wave, -1, 1)


def decode_flac(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        (stream,) = container.streams.audio
        channels = stream.codec_context.channels
        # packed 16-bit samples come as one row, [s0c0, s0c1, s1c0, ...]; planar as a row per channel
        chunks = [
            f.to_ndarray() if f.format.is_planar else f.to_ndarray().reshape(-1, channels).T
            for f in container.decode(stream)
        ]
        return np.concatenate(chunks, axis=1).astype(np.float32) / 32767.0, stream.rate


async def create(session, base_url: str, body: dict) -> dict:
    async with session.post(f"{base_url}{ROUTE}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def wait_for(session, base_url: str, job_id: str, *statuses: str) -> dict:
    for _ in range(2400):
        async with session.get(f"{base_url}{ROUTE}/{job_id}") as resp:
            job = await resp.json()
        if job["status"] in statuses:
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached {statuses}: {job}")


@pytest.mark.asyncio
async def test_jobs_make_the_pipeline_s_sound_as_wav_or_flac(serve, tiny_stable_audio, stable_audio):
    server = serve(model=tiny_stable_audio)
    base = server.base_url
    flac_body = {"prompt": "a dog barking", "seed": 3, "num_inference_steps": 3, "seconds": 0.5, "format": "flac"}
    wav_body = {"prompt": "rain on a roof", "seed": 4, "num_inference_steps": 2, "negative_prompt": "wind"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        flac_job = await create(session, base, flac_body)
        assert flac_job["object"] == "audio" and flac_job["id"].startswith("audio_") and flac_job["seconds"] == "0.5"
        assert "size" not in flac_job and "num_frames" not in flac_job
        wav_job = await create(session, base, wav_body)
        flac_job = await wait_for(session, base, flac_job["id"], "completed", "failed")
        wav_job = await wait_for(session, base, wav_job["id"], "completed", "failed")
        files = {}
        for job in (flac_job, wav_job):
            assert job["status"] == "completed" and job["progress"] == 100, job
            async with session.get(f"{base}{ROUTE}/{job['id']}/content") as resp:
                assert resp.status == 200
                files[job["format"]] = (resp.headers["Content-Type"], await resp.read())
        async with session.get(f"{base}{ROUTE}") as resp:
            listed = [j["id"] for j in (await resp.json())["data"]]
        async with session.get(f"{base}/v1/videos") as resp:
            videos = (await resp.json())["data"]
        async with session.get(f"{base}/v1/videos/{wav_job['id']}") as resp:
            assert resp.status == 404  # a sound job is no video
        async with session.post(f"{base}/v1/videos", json={"prompt": "x"}) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == "model" and ROUTE in error["message"], error
        async with session.post(f"{base}{ROUTE}", json={"prompt": "x", "size": "64x64"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "size"
        async with session.post(
            f"{base}{ROUTE}", json={"prompt": "x", "seconds": 1, "arguments": {"audio_end_in_s": 1}}
        ) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "seconds"
    assert {flac_job["id"], wav_job["id"]} <= set(listed) and videos == []
    media, data = files["flac"]
    samples, rate = decode_flac(data)
    reference = expected(stable_audio, flac_body)
    assert media == "audio/flac" and rate == flac_job["sample_rate"] and samples.shape == reference.shape
    assert float(np.abs(samples - reference).max()) <= 2 / 32767
    assert float(flac_job["seconds"]) == pytest.approx(reference.shape[1] / rate, abs=1e-3)
    media, data = files["wav"]
    sound = decode_wav(data)
    reference = expected(stable_audio, wav_body)
    assert media == "audio/wav" and sound.samples.shape == reference.shape
    assert float(np.abs(sound.samples - reference).max()) <= 2 / 32767


@pytest.mark.asyncio
async def test_a_delete_stops_a_running_job(serve, tiny_stable_audio):
    server = serve(model=tiny_stable_audio)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        job = await create(session, server.base_url, {"prompt": "a long one", "seed": 1, "num_inference_steps": 900})
        await server_progress(session, server.base_url, job["id"])
        async with session.delete(f"{server.base_url}{ROUTE}/{job['id']}") as resp:
            assert resp.status == 200 and (await resp.json())["object"] == "audio.deleted"
        async with session.get(f"{server.base_url}{ROUTE}/{job['id']}") as resp:
            assert resp.status == 404
    record = server.state.records[job["id"].removeprefix("audio_")]
    assert record.status == "cancelled" and record.step < 900, record


async def server_progress(session, base_url: str, job_id: str) -> None:
    for _ in range(2400):
        async with session.get(f"{base_url}{ROUTE}/{job_id}") as resp:
            if (await resp.json())["progress"] > 0:
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} never started")


def test_a_job_left_running_at_a_shutdown_runs_again(tiny_stable_audio, stable_audio, tmp_path):
    body = {"prompt": "a bell", "seed": 8, "num_inference_steps": 400, "format": "flac"}

    def start() -> tuple[ServerThread, object]:
        config = ServeConfig(port=0, model=tiny_stable_audio, max_steps=1000, state_dir=str(tmp_path / "state"))
        thread = ServerThread(config, tiny_stable_audio)
        return thread, thread.start()

    async def first(base_url: str) -> dict:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            job = await create(session, base_url, body)
            await server_progress(session, base_url, job["id"])
            return job

    async def second(base_url: str, job_id: str) -> tuple[dict, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            job = await wait_for(session, base_url, job_id, "completed", "failed")
            async with session.get(f"{base_url}{ROUTE}/{job_id}/content") as resp:
                return job, await resp.read()

    thread, server = start()
    try:
        job = asyncio.run(first(server.base_url))
    finally:
        thread.stop()
    thread, server = start()
    try:
        job, data = asyncio.run(second(server.base_url, job["id"]))
        # admitted again here (not a job the first run finished before it stopped)
        rerun = server.call(lambda: server.state.records[job["id"].removeprefix("audio_")].status)
    finally:
        thread.stop()
    assert job["status"] == "completed" and rerun == "completed", (job, rerun)
    samples, _ = decode_flac(data)
    assert float(np.abs(samples - expected(stable_audio, body)).max()) <= 2 / 32767
