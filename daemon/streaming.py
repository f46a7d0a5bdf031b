"""What the HTTP routes share: queueing a request's siblings together, image encoding off the loop, SSE framing,
terminal events as OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.state import METRICS, ServerState
from diffusiond.engine.engine import Engine, QueueFullError, RequestHandle
from diffusiond.engine.outputs import Cancelled, Event, Failed
from diffusiond.engine.request import SamplingParams


async def encode_off_loop(request: web.Request, fn, *args) -> bytes:
    """Image encoding off the event loop, timed as the encode_response stage."""
    t0 = time.perf_counter()
    data = await asyncio.to_thread(fn, *args)
    request.app[METRICS].stage_seconds.labels("encode_response").observe(time.perf_counter() - t0)
    return data


def queue_requests(engine: Engine, state: ServerState, params: list[SamplingParams]) -> list[RequestHandle]:
    if not engine.has_capacity(len(params)):
        raise QueueFullError(f"{engine.num_in_flight} requests in flight")
    handles = []
    try:
        for p in params:
            handles.append(engine.add_request(p))
            state.record(handles[-1])
    except Exception:
        for h in handles:
            h.cancel()
        raise
    return handles


async def last_event(events: AsyncIterator[Event]) -> Event:
    last = None
    async for event in events:
        last = event
    assert last is not None
    return last


def terminal_error(event: Event) -> ApiError:
    if isinstance(event, Cancelled):
        return ApiError(503, f"request cancelled: {event.reason}", type="server_error", code="cancelled")
    message = event.error if isinstance(event, Failed) else str(event)
    return ApiError(500, f"generation failed: {message}", type="server_error", code="generation_failed")


def sse_event(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


async def start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
    )
    await response.prepare(request)
    return response
