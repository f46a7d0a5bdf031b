"""`Idempotency-Key` (daemon/idempotency.py): the same POST with the same key, sent 5 times at once, runs once and
every copy gets the first answer byte for byte; another body under the key is 422; a streamed answer is not sent
twice (409 naming its request); an error is not kept. Broken on purpose once: with the lookup of an existing key
skipped (`entry = None`), the 5 concurrent image requests made 5 requests (red)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.idempotency import IdempotencyKeys, fingerprint
from diffusiond.daemon.replay import REPLAYS
from diffusiond.daemon.videos_api import VIDEOS

TIMEOUT = aiohttp.ClientTimeout(total=120)
IMAGE = {"prompt": "a cat, once", "size": "64x64", "num_inference_steps": 2}


@pytest.mark.asyncio
async def test_five_concurrent_image_requests_with_one_key_run_once(server):
    base = server.base_url
    before = set(server.state.records)
    headers = {"Idempotency-Key": "retry-me-1"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

        async def post() -> tuple[int, bytes, dict]:
            async with session.post(f"{base}/v1/images/generations", json=IMAGE, headers=headers) as resp:
                return resp.status, await resp.read(), {k.lower(): v for k, v in resp.headers.items()}

        answers = await asyncio.gather(*(post() for _ in range(5)))
        assert [status for status, _, _ in answers] == [200] * 5, answers[0][1][:300]
        assert len({body for _, body, _ in answers}) == 1  # the same images, byte for byte
        assert sorted(h.get("idempotent-replayed") for _, _, h in answers if "idempotent-replayed" in h) == ["true"] * 4
        assert len({h["x-request-id"] for _, _, h in answers}) == 1
        assert len(set(server.state.records) - before) == 1  # one request reached the engine

        # Later, the same again: the kept answer; another body under the key: 422.
        async with session.post(f"{base}/v1/images/generations", json=IMAGE, headers=headers) as resp:
            assert resp.status == 200 and await resp.read() == answers[0][1]
        other = {**IMAGE, "prompt": "a dog"}
        async with session.post(f"{base}/v1/images/generations", json=other, headers=headers) as resp:
            assert resp.status == 422, await resp.text()
            error = (await resp.json())["error"]
            assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
        async with session.post(
            f"{base}/v1/images/generations", json=IMAGE, headers={"Idempotency-Key": "a b"}
        ) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "Idempotency-Key"
        assert len(set(server.state.records) - before) == 1


@pytest.mark.asyncio
async def test_a_streamed_answer_is_not_sent_twice(server):
    """A repeat of a stream, while its events are kept (daemon/replay.py), follows that stream (its request, not a
    second one); once they are not, 409 naming the first's request."""
    base = server.base_url
    body = {"prompt": "a stream, once", "width": 64, "height": 64, "num_inference_steps": 1000, "seed": 3}
    headers = {"Idempotency-Key": "stream-1"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{base}/v1/generations", json=body, headers=headers) as stream:
            assert stream.status == 200
            rid = stream.headers["X-Request-Id"]
            await stream.content.readline()
            records = len(server.call(lambda: list(server.state.records)))
            async with session.post(f"{base}/v1/generations", json=body, headers=headers) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == rid, await resp.text()
                async with session.delete(f"{base}/v1/generations/{rid}") as cancel:
                    assert cancel.status == 202
                second = await resp.read()
            first = await stream.read()
        assert len(server.call(lambda: list(server.state.records))) == records  # one request
        for copy in (first, second):
            assert copy.rstrip().split(b"\n\n")[-1].startswith(b"event: cancelled\n"), copy[-200:]
        server.call(lambda: server.app[REPLAYS].streams.pop(rid).close())  # its window passed
        async with session.post(f"{base}/v1/generations", json=body, headers=headers) as resp:
            assert resp.status == 409, await resp.text()
            error = (await resp.json())["error"]
            assert error["code"] == "idempotency_key_streamed" and rid in error["message"]


@pytest.fixture(scope="module")
def video_server(serve, tiny_wan):
    return serve(model=tiny_wan, max_pixels=64 * 64)


@pytest.mark.asyncio
async def test_five_concurrent_video_jobs_with_one_key_are_one_job(video_server):
    base = video_server.base_url
    clip = {"prompt": "a clip, once", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 1}
    store = video_server.app[VIDEOS].store
    before = set(store.jobs)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

        async def post() -> tuple[int, dict]:
            async with session.post(f"{base}/v1/videos", json=clip, headers={"Idempotency-Key": "job-1"}) as resp:
                return resp.status, await resp.json()

        answers = await asyncio.gather(*(post() for _ in range(5)))
    assert [status for status, _ in answers] == [200] * 5, answers
    assert len({job["id"] for _, job in answers}) == 1
    assert len(set(store.jobs) - before) == 1


@pytest.mark.asyncio
async def test_errors_are_not_kept_and_tenants_keys_are_their_own():
    keys = IdempotencyKeys()
    calls = []

    class Request(dict):
        method, path = "POST", "/v1/videos"

        def __init__(self) -> None:
            super().__init__()
            self.headers = {"Idempotency-Key": "k"}

    async def failing():
        calls.append("fail")
        raise ApiError(429, "full", code="queue_full")

    async def answering():
        from aiohttp import web

        calls.append("ok")
        return web.json_response({"n": len(calls)})

    with pytest.raises(ApiError):
        await keys.once(Request(), "alice", fingerprint("x"), failing)
    first = await keys.once(Request(), "alice", fingerprint("x"), answering)  # the error was not kept: runs
    again = await keys.once(Request(), "alice", fingerprint("x"), answering)
    bob = await keys.once(Request(), "bob", fingerprint("x"), answering)  # the same key string, another tenant
    assert calls == ["fail", "ok", "ok"]
    assert json.loads(first.body) == json.loads(again.body) == {"n": 2} and json.loads(bob.body) == {"n": 3}
    assert again.headers["Idempotent-Replayed"] == "true"


@pytest.mark.asyncio
async def test_one_tenant_s_traffic_never_pushes_out_another_s_keys():
    """Past the bound, the tenant that holds the most forgets its own oldest first: bob's flood of keys leaves
    alice's two (with one LRU for all, they went first: red)."""
    from aiohttp import web

    keys = IdempotencyKeys(max_entries=6)
    runs: list[str] = []

    class Request(dict):
        method, path = "POST", "/v1/images/generations"

        def __init__(self, key: str) -> None:
            super().__init__()
            self.headers = {"Idempotency-Key": key}

    async def run(tenant: str, key: str):
        async def make():
            runs.append(f"{tenant}:{key}")
            return web.json_response({"key": key})

        return await keys.once(Request(key), tenant, fingerprint(key), make)

    for key in ("a1", "a2"):
        await run("alice", key)
    for n in range(20):
        await run("bob", f"b{n}")
    assert len(keys.entries) == 6 and {t: n for t, (n, _) in keys.held.items()} == {"alice": 2, "bob": 4}
    before = list(runs)
    for key in ("a1", "a2"):
        assert (await run("alice", key)).headers["Idempotent-Replayed"] == "true"
    assert runs == before  # alice's answers were kept: nothing ran again
    await run("bob", "b0")  # bob's oldest went: it runs again
    assert runs == [*before, "bob:b0"]
