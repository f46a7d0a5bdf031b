"""OpenAI requests get no progress events (their clients never see them, and each would wake the event loop every
step), yet their status is current: it comes from the engine's step count."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from diffusiond.engine.outputs import Progress


@pytest.mark.asyncio
async def test_openai_requests_send_no_progress_events_but_report_their_step(server, monkeypatch):
    engine = server.state.engine
    progress: list[str] = []
    real = engine.on_event

    def on_event(event):
        if isinstance(event, Progress):
            progress.append(event.request_id)
        real(event)

    monkeypatch.setattr(engine, "on_event", on_event)
    body = {"prompt": "a long one", "size": "64x64", "num_inference_steps": 1000, "seed": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        post = asyncio.create_task(session.post(f"{server.base_url}/v1/images/generations", json=body))
        await asyncio.to_thread(server.wait_until, lambda: server.num_in_flight() == 1, 10, "the request")
        rid = list(server.state.records)[-1]
        record = {}
        for _ in range(200):
            async with session.get(f"{server.base_url}/v1/generations/{rid}") as resp:
                record = await resp.json()
            if record["status"] == "running" and record["step"] >= 3:
                break
            await asyncio.sleep(0.02)
        assert record["status"] == "running" and 3 <= record["step"] < 1000, record
        async with session.delete(f"{server.base_url}/v1/generations/{rid}") as resp:
            assert resp.status == 202
        resp = await post
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "cancelled"
    assert rid not in progress
    await asyncio.to_thread(server.wait_idle)
    assert rid not in engine.steps_done
