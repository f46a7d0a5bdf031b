"""The HTTP surface over a real socket with aiohttp's client: pixel parity with diffusers, input validation, the
native SSE API, cancellation (DELETE and client disconnect), auth, backpressure and the error shape of routing errors.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import aiohttp
import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from sse import sse_events

from diffusiond.engine.outputs import Completed
from diffusiond.models.params import SamplingParams

# A request long enough to still be running when the test acts on it (max steps: 1000, ~10 ms each here).
LONG_STEPS = 1000
TIMEOUT = aiohttp.ClientTimeout(total=60)


# ---- helpers ----


def decode_png(b64: str) -> np.ndarray:
    data = base64.b64decode(b64)
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def assert_error_shape(body: dict, *, param: str | None = None, check_param: bool = True) -> dict:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if check_param:
        assert error["param"] == param, error
    return error


async def wait_for_status(session, base_url: str, rid: str, status: str, within: float = 15.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        async with session.get(f"{base_url}/v1/generations/{rid}") as resp:
            assert resp.status == 200, await resp.text()
            record = await resp.json()
        if record["status"] == status:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"request {rid} did not reach status {status!r} within {within}s; last: {record}")
        await asyncio.sleep(0.05)


async def wait_until(predicate, within: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


def long_native(**kw) -> dict:
    return {"prompt": "a long one", "seed": 1, "width": 64, "height": 64, "num_inference_steps": LONG_STEPS, **kw}


async def read_until_progress(resp: aiohttp.ClientResponse) -> list[tuple[str, dict]]:
    seen = []
    async for name, data in sse_events(resp):
        seen.append((name, data))
        if name == "progress":
            return seen
    raise AssertionError(f"stream ended before any progress event: {seen}")


# ---- pixel parity ----


def test_http_image_equals_engine_and_diffusers(server, model_id, tiny_sd3):
    prompt, seed, steps, guidance = "a blue square", 11, 5, 5.0
    body = {
        "model": model_id,
        "prompt": prompt,
        "size": "64x64",
        "n": 1,
        "response_format": "b64_json",
        "seed": seed,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
    }

    async def over_http() -> np.ndarray:
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(f"{server.base_url}/v1/images/generations", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            payload = await resp.json()
        assert len(payload["data"]) == 1
        return decode_png(payload["data"][0]["b64_json"])

    http_image = asyncio.run(over_http())
    assert http_image.shape == (64, 64, 3)

    params = SamplingParams(
        prompt=prompt, seed=seed, width=64, height=64, num_inference_steps=steps, guidance_scale=guidance
    )
    engine_result = server.run(lambda: server.state.engine.add_request(params).result())
    assert isinstance(engine_result, Completed), engine_result
    engine_image = (np.clip(engine_result.image, 0, 1) * 255).round().astype(np.uint8)
    np.testing.assert_array_equal(http_image, engine_image)

    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        prompt=prompt,
        width=64,
        height=64,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).images[0]
    expected = (reference * 255).round().astype(np.uint8)
    diff = np.abs(http_image.astype(int) - expected.astype(int))
    assert diff.max() <= 1, f"max abs diff {diff.max()}"
    assert (diff == 0).mean() > 0.99, f"only {(diff == 0).mean():.4f} of pixels equal"
    # Not vacuous: the image has structure, and another seed gives a clearly different one.
    assert http_image.std() > 1.0
    other = pipe(
        prompt=prompt,
        width=64,
        height=64,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed + 1),
        output_type="np",
    ).images[0]
    assert np.abs((other * 255).round().astype(int) - http_image.astype(int)).max() > 10


# ---- malformed requests ----

GOOD = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 2, "seed": 0}

# id -> (body: dict | list | bytes, expected status, expected param)
MALFORMED = {
    "bad-json": (b"{", 400, None),
    "json-array": ([GOOD], 400, None),
    "prompt-int": ({**GOOD, "prompt": 1}, 400, "prompt"),
    "n-string": ({**GOOD, "n": "3"}, 400, "n"),
    "size-big": ({**GOOD, "size": "big"}, 400, "size"),
    "size-65x64": ({**GOOD, "size": "65x64"}, 400, "size"),
    "n-0": ({**GOOD, "n": 0}, 400, "n"),
    "n-11": ({**GOOD, "n": 11}, 400, "n"),
    "steps-0": ({**GOOD, "num_inference_steps": 0}, 400, "num_inference_steps"),
    "steps-neg": ({**GOOD, "num_inference_steps": -1}, 400, "num_inference_steps"),
    "prompt-20k": ({**GOOD, "prompt": "a" * 20_000}, 400, "prompt"),
    "body-over-1mib": ({**GOOD, "prompt": "a" * ((1 << 20) + 1024)}, 413, None),
    "missing-prompt": ({k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt"),
    "unknown-field": ({**GOOD, "frobnicate": True}, 400, "frobnicate"),
    "response-format-url-streamed": ({**GOOD, "response_format": "url", "stream": True}, 400, "response_format"),
    "response-format-blob": ({**GOOD, "response_format": "blob"}, 400, "response_format"),
    "partial-images-4": ({**GOOD, "stream": True, "partial_images": 4}, 400, "partial_images"),
    "background-transparent": ({**GOOD, "background": "transparent"}, 400, "background"),
    "output-format-gif": ({**GOOD, "output_format": "gif"}, 400, "output_format"),
    "model-nope": ({**GOOD, "model": "nope"}, 404, "model"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request(server, case):
    body, status, param = MALFORMED[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(
            f"{server.base_url}/v1/images/generations",
            # aiohttp warns on large raw bytes bodies; a file object is sent in chunks, with a Content-Length.
            data=io.BytesIO(data),
            headers={"Content-Type": "application/json", "Content-Length": str(len(data))},
        ) as resp,
    ):
        assert resp.status == status, await resp.text()
        assert resp.content_type == "application/json"
        error = assert_error_shape(await resp.json(), param=param)
    assert error["type"] == "invalid_request_error"
    assert "X-Request-Id" not in resp.headers, "a rejected request must not be queued"
    await wait_until(lambda: server.num_in_flight() == 0, within=5.0, what="no request in flight")


@pytest.mark.asyncio
async def test_server_still_serves_after_malformed_requests(server, model_id):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(
            f"{server.base_url}/v1/images/generations", json={**GOOD, "model": model_id, "response_format": "b64_json"}
        ) as resp:
            assert resp.status == 200, await resp.text()
            payload = await resp.json()
        assert decode_png(payload["data"][0]["b64_json"]).shape == (64, 64, 3)
        async with session.get(f"{server.base_url}/health") as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ok"
    await wait_until(lambda: server.num_in_flight() == 0, what="no request in flight")
    assert not server.state.engine.executor.states


# ---- native SSE API ----


@pytest.mark.asyncio
async def test_native_stream_events(server):
    steps = 6
    body = {
        "prompt": "a green triangle",
        "seed": 5,
        "width": 64,
        "height": 64,
        "num_inference_steps": steps,
        "preview_every": 1,
        "latents": True,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{server.base_url}/v1/generations", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.content_type == "text/event-stream"
            rid = resp.headers["X-Request-Id"]
            events = [e async for e in sse_events(resp)]
        names = [name for name, _ in events]
        for name, data in events:
            assert data["type"] == name and data["id"] == rid, (name, data)

        assert names[0] == "queued", names
        terminal = [n for n in names if n in ("completed", "cancelled", "failed")]
        assert terminal == ["completed"] and names[-1] == "completed", names

        # Progress is in order and reaches the last step (a slow reader may skip intermediate ones: they coalesce).
        progress = [data for name, data in events if name == "progress"]
        assert progress and all(p["total"] == steps for p in progress)
        progress_steps = [p["step"] for p in progress]
        assert progress_steps == sorted(set(progress_steps)), progress_steps
        assert progress_steps[0] >= 1 and progress_steps[-1] == steps, progress_steps

        previews = [data for name, data in events if name == "preview"]
        assert previews, names
        for preview in previews:
            assert 1 <= preview["step"] < steps and preview["total"] == steps
            image = decode_png(preview["b64"])
            assert image.shape == (preview["height"], preview["width"], 3)

        latents = [data for name, data in events if name == "latent"]
        assert latents, names
        for latent in latents:
            assert latent["dtype"] == "float32" and 1 <= latent["step"] < steps
            raw = base64.b64decode(latent["b64"])
            shape = tuple(latent["shape"])
            assert len(shape) == 3 and shape[1:] == (8, 8), shape  # [C, h, w] at 1/8 of 64x64
            array = np.frombuffer(raw, dtype=np.float32)
            assert array.size == int(np.prod(shape)), (array.size, shape)
            assert np.isfinite(array).all() and array.std() > 0

        completed = events[-1][1]
        assert completed["seed"] == 5
        assert [img["format"] for img in completed["images"]] == ["png"]
        final = decode_png(completed["images"][0]["b64"])
        assert final.shape == (64, 64, 3) and final.std() > 1.0

        async with session.get(f"{server.base_url}/v1/generations/{rid}") as resp:
            assert resp.status == 200
            record = await resp.json()
    assert record["id"] == rid and record["status"] == "completed", record
    assert record["step"] == record["total"] == steps and record["error"] is None
    assert isinstance(record["created"], int)
    assert rid not in server.state.engine.executor.states


@pytest.mark.asyncio
async def test_native_latents_without_previews_is_rejected(server):
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{server.base_url}/v1/generations", json={"prompt": "x", "latents": True}) as resp,
    ):
        assert resp.status == 400
        assert_error_shape(await resp.json(), param="latents")


@pytest.mark.asyncio
async def test_status_and_cancel_of_unknown_id_are_404(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for method in ("GET", "DELETE"):
            async with session.request(method, f"{server.base_url}/v1/generations/does-not-exist") as resp:
                assert resp.status == 404, method
                assert_error_shape(await resp.json(), param="id")


# ---- cancellation ----


@pytest.mark.asyncio
async def test_delete_cancels_a_running_stream(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{server.base_url}/v1/generations", json=long_native()) as resp:
            assert resp.status == 200
            rid = resp.headers["X-Request-Id"]
            seen = await read_until_progress(resp)
            async with session.delete(f"{server.base_url}/v1/generations/{rid}") as cancel:
                assert cancel.status == 202, await cancel.text()
                assert (await cancel.json())["cancel_requested"] is True
            seen += [e async for e in sse_events(resp)]
        names = [name for name, _ in seen]
        assert names[-1] == "cancelled", names
        assert not {"completed", "failed"} & set(names), names
        last_progress = max(d["step"] for n, d in seen if n == "progress")
        assert last_progress < LONG_STEPS

        record = await wait_for_status(session, server.base_url, rid, "cancelled")
        assert record["step"] < record["total"] == LONG_STEPS
        # Cancelling a finished request is a conflict.
        async with session.delete(f"{server.base_url}/v1/generations/{rid}") as again:
            assert again.status == 409
            error = (await again.json())["error"]  # the OpenAI error shape, like every other error
            assert error["code"] == "already_finished" and error["param"] == "id", error
            assert "completed" in error["message"] or "cancelled" in error["message"], error
    assert rid not in server.state.engine.executor.states
    await wait_until(lambda: server.num_in_flight() == 0, what="no request in flight")


async def disconnect_native(server, session) -> str:
    """Open a long native stream, read until a progress event, drop the connection; returns the request id."""
    resp = await session.post(f"{server.base_url}/v1/generations", json=long_native())
    try:
        assert resp.status == 200
        rid = resp.headers["X-Request-Id"]
        await read_until_progress(resp)
    finally:
        resp.close()  # drops the connection mid-stream
    return rid


async def time_out_openai(server) -> str:
    """Start a long non-streaming OpenAI request and give up on it client-side; returns its request id."""
    before = set(server.call(lambda: list(server.state.records)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                f"{server.base_url}/v1/images/generations",
                json={**GOOD, "num_inference_steps": LONG_STEPS, "response_format": "b64_json"},
            ) as resp:
                await resp.read()
    new = [rid for rid in server.call(lambda: list(server.state.records)) if rid not in before]
    assert len(new) == 1, new
    return new[0]


async def assert_stopped_early(server, rid: str) -> None:
    # 1000 steps take ~10 s here: the engine must stop the request long before that.
    await wait_until(lambda: server.num_in_flight() == 0, within=3.0, what="the request to be cancelled")
    assert rid not in server.state.engine.executor.states
    record = server.record(rid)
    assert record is not None and record["status"] != "completed", record
    assert record["step"] < LONG_STEPS


@pytest.mark.asyncio
async def test_a_native_stream_left_without_a_client_is_cancelled_after_the_window(server):
    """A native stream's request waits --reconnect-window for its client to come back (daemon/replay.py), runs on
    meanwhile, then is cancelled, and its record says so."""
    window = server.state.config.reconnect_window
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        rid = await disconnect_native(server, session)
        left = time.monotonic()
        await asyncio.sleep(window / 2)
        assert server.record(rid)["status"] == "running", server.record(rid)  # not at once: it may come back
        await wait_until(lambda: server.num_in_flight() == 0, within=window + 3.0, what="the request to be cancelled")
        assert time.monotonic() - left >= window * 0.9
        record = await wait_for_status(session, server.base_url, rid, "cancelled", within=3.0)
    assert record["step"] < LONG_STEPS
    assert rid not in server.state.engine.executor.states


@pytest.mark.asyncio
async def test_disconnect_cancels_a_non_streaming_openai_request(server):
    rid = await time_out_openai(server)
    await assert_stopped_early(server, rid)


@pytest.mark.asyncio
async def test_disconnect_openai_request_record_says_cancelled(server):
    rid = await time_out_openai(server)
    await assert_stopped_early(server, rid)
    await wait_until(lambda: server.record(rid)["status"] == "cancelled", within=3.0, what="status 'cancelled'")


# ---- auth ----


@pytest.mark.asyncio
async def test_api_key(auth_server, model_id):
    base = auth_server.base_url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "secret"},
            {"Authorization": "Basic x"},
        ):
            for method, path in (
                ("GET", "/v1/models"),
                ("POST", "/v1/images/generations"),
                ("GET", "/v1/generations/x"),
            ):
                async with session.request(method, f"{base}{path}", headers=headers, json=GOOD) as resp:
                    assert resp.status == 401, (headers, path, await resp.text())
                    error = assert_error_shape(await resp.json(), check_param=False)
                    assert error["code"] == "invalid_api_key"
        for path in ("/health", "/ready"):
            async with session.get(f"{base}{path}") as resp:
                assert resp.status == 200, path

        good = {"Authorization": "Bearer secret"}
        async with session.get(f"{base}/v1/models", headers=good) as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == [model_id]
        async with session.post(
            f"{base}/v1/images/generations", headers=good, json={**GOOD, "response_format": "b64_json"}
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert decode_png((await resp.json())["data"][0]["b64_json"]).shape == (64, 64, 3)


# ---- backpressure ----


async def cancel_and_drain(session, base: str, accepted: list[aiohttp.ClientResponse]) -> list[list[str]]:
    """DELETE every accepted request, then read each stream to its end; returns the event names of each."""
    for r in accepted:
        async with session.delete(f"{base}/v1/generations/{r.headers['X-Request-Id']}") as cancel:
            assert cancel.status == 202, await cancel.text()
    return [[name async for name, _ in sse_events(r)] for r in accepted]


@pytest.mark.asyncio
async def test_full_queue_answers_429_then_recovers(small_server):
    base = small_server.base_url
    capacity = small_server.config.max_batch + small_server.config.max_queue
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        # One request running first (so that the next one has to wait), then a burst.
        responses = [await session.post(f"{base}/v1/generations", json=long_native(seed=100))]
        try:
            assert responses[0].status == 200
            await read_until_progress(responses[0])
            responses += await asyncio.gather(
                *(session.post(f"{base}/v1/generations", json=long_native(seed=i)) for i in range(capacity + 1))
            )
            statuses = [r.status for r in responses]
            accepted = [r for r in responses if r.status == 200]
            rejected = [r for r in responses if r.status == 429]
            assert len(accepted) == capacity and len(rejected) == len(responses) - capacity, statuses
            for r in rejected:
                assert int(r.headers["Retry-After"]) >= 1
                error = assert_error_shape(await r.json(), check_param=False)
                assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
                assert "X-Request-Id" not in r.headers
            # The OpenAI route is refused too while full.
            async with session.post(f"{base}/v1/images/generations", json=GOOD) as resp:
                assert resp.status == 429
                assert int(resp.headers["Retry-After"]) >= 1
                assert_error_shape(await resp.json(), check_param=False)
            for names in await cancel_and_drain(session, base, accepted):
                terminal = [n for n in names if n in ("completed", "cancelled", "failed")]
                assert terminal == ["cancelled"] and names[-1] == "cancelled", names
        finally:
            for r in responses:
                r.release()
        await wait_until(lambda: small_server.num_in_flight() == 0, what="the cancelled requests to end")
        assert not small_server.state.engine.executor.states
        async with session.post(f"{base}/v1/images/generations", json={**GOOD, "response_format": "b64_json"}) as resp:
            assert resp.status == 200, await resp.text()
            assert decode_png((await resp.json())["data"][0]["b64_json"]).shape == (64, 64, 3)


@pytest.mark.asyncio
async def test_request_within_capacity_is_served(small_server):
    # n=2 fits the capacity (max_batch + max_queue = 2), and both requests reach the engine in the same tick.
    capacity = small_server.config.max_batch + small_server.config.max_queue
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(
            f"{small_server.base_url}/v1/images/generations",
            json={**GOOD, "n": capacity, "response_format": "b64_json"},
        ) as resp,
    ):
        body = await resp.json()
    await wait_until(lambda: small_server.num_in_flight() == 0, what="the requests to end")
    assert resp.status == 200, body
    assert len(body["data"]) == capacity


# ---- routing errors ----


@pytest.mark.asyncio
async def test_unknown_path_is_404_and_wrong_method_405(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{server.base_url}/v1/nothing-here") as resp:
            assert resp.status == 404
            error = assert_error_shape(await resp.json(), check_param=False)
            assert error["type"] == "invalid_request_error"
        async with session.get(f"{server.base_url}/v1/images/generations") as resp:
            assert resp.status == 405
            error = assert_error_shape(await resp.json(), check_param=False)
            assert error["type"] == "invalid_request_error"


@pytest.mark.asyncio
async def test_405_names_the_allowed_methods(server):
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"{server.base_url}/v1/images/generations") as resp,
    ):
        assert resp.status == 405
        assert "POST" in resp.headers.get("Allow", ""), dict(resp.headers)
