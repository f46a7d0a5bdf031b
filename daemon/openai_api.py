"""OpenAI Images API: `POST /v1/images/generations`, non-streaming and streaming with real partial images."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from diffusiond.daemon.api import ApiError, ImageGenerationRequest, decode_body, parse_size, validate_openai
from diffusiond.daemon.images import encode_image, encode_preview
from diffusiond.daemon.state import STATE, ServerState
from diffusiond.daemon.streaming import (
    encode_off_loop,
    last_event,
    queue_requests,
    sse_event,
    start_sse,
    terminal_error,
)
from diffusiond.engine.engine import RequestHandle
from diffusiond.engine.outputs import Cancelled, Completed, Event, Failed, Preview
from diffusiond.engine.request import SamplingParams


def _partial_every(steps: int, partial_images: int) -> int:
    """The widest preview spacing that still yields `partial_images` previews before the final step."""
    return max(1, (steps - 1) // partial_images) if partial_images else 0


async def images_generations(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request.read(), ImageGenerationRequest)
    validate_openai(body)
    engine = state.require_engine()
    if body.model is not None and body.model != state.model_id:
        raise ApiError(
            404,
            f"model {body.model!r} not found; this server serves {state.model_id!r}",
            param="model",
            code="model_not_found",
        )
    width, height = parse_size(body.size)
    n = body.n or 1
    base = SamplingParams(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        seed=body.seed,
        width=width,
        height=height,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
    )
    resolved = engine.adapter.resolve(base)  # raises ParamError (400) before anything is queued
    assert resolved.seed is not None
    partial = body.partial_images or 0
    every = _partial_every(resolved.num_inference_steps or 1, partial)
    handles = queue_requests(
        engine,
        state,
        [msgspec.structs.replace(resolved, seed=(resolved.seed + i) % (2**63), preview_every=every) for i in range(n)],
    )
    fmt = body.output_format or "png"
    meta = {
        "size": f"{resolved.width}x{resolved.height}",
        "quality": body.quality if body.quality in ("low", "medium", "high") else "auto",
        "background": "opaque",
        "output_format": fmt,
    }
    headers = {"X-Request-Id": ",".join(h.request_id for h in handles)}
    if body.stream:
        return await _openai_stream(request, state, handles, fmt, body.output_compression, partial, meta, headers)
    results = await asyncio.gather(*(last_event(state.track(h)) for h in handles))
    for result in results:
        if not isinstance(result, Completed):
            raise terminal_error(result)
    images = [await encode_off_loop(request, encode_image, r.image, fmt, body.output_compression) for r in results]
    payload = {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(img).decode()} for img in images],
        **{k: v for k, v in meta.items() if k != "quality" or v != "auto"},
        "usage": _usage(),
    }
    return web.json_response(payload, headers=headers, dumps=lambda o: msgspec.json.encode(o).decode())


def _usage() -> dict:
    # Diffusion models are not billed in tokens; the fields exist so that OpenAI clients parse the response.
    return {
        "input_tokens": 0,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
        "output_tokens": 0,
        "total_tokens": 0,
    }


async def _merged(state: ServerState, handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Event]]:
    """Events of several requests as they come, tagged with the request's index."""
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for event in state.track(handle):
                queue.put_nowait((i, event))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            i, event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _openai_stream(request, state, handles, fmt, compression, partial, meta, headers) -> web.StreamResponse:
    response = await start_sse(request, headers)
    width, height = (int(v) for v in meta["size"].split("x"))
    sent = [0] * len(handles)
    async for i, event in _merged(state, handles):
        if isinstance(event, Preview) and sent[i] < partial:
            data = await encode_off_loop(request, encode_preview, event.image, (width, height), fmt, compression)
            await response.write(
                sse_event(
                    "image_generation.partial_image",
                    {
                        "type": "image_generation.partial_image",
                        "b64_json": base64.b64encode(data).decode(),
                        "partial_image_index": sent[i],
                        "created_at": int(time.time()),
                        **meta,
                    },
                )
            )
            sent[i] += 1
        elif isinstance(event, Completed):
            data = await encode_off_loop(request, encode_image, event.image, fmt, compression)
            await response.write(
                sse_event(
                    "image_generation.completed",
                    {
                        "type": "image_generation.completed",
                        "b64_json": base64.b64encode(data).decode(),
                        "created_at": int(time.time()),
                        **meta,
                        "usage": _usage(),
                    },
                )
            )
        elif isinstance(event, Cancelled | Failed):
            await response.write(sse_event("error", {"type": "error", **terminal_error(event).body()}))
    await response.write_eof()
    return response
