"""What the HTTP routes share: image encoding off the loop, SSE framing and keepalives, clients that hang up, terminal
events as OpenAI-shaped errors. What a request must pass to be queued: daemon/admission.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import msgspec
import numpy as np
from aiohttp import web

from diffusiond.daemon.api import ApiError, NotStarted
from diffusiond.daemon.image_encoding import INLINE_PIXELS, encode_image
from diffusiond.daemon.state import ENCODERS, METRICS, STATE
from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Cancelled, Event, Failed
from diffusiond.models.inputs import admit_image, input_pixel_limit
from diffusiond.models.params import ParamError

log = logging.getLogger(__name__)
T = TypeVar("T")
KEEPALIVE = b": keepalive\n\n"


class ClientGone(Exception):
    """The client hung up while its stream was written. Not an error: the error middleware logs one INFO line and
    hands aiohttp the response it already started."""

    def __init__(self, response: web.StreamResponse, request_ids: list[str]) -> None:
        super().__init__(", ".join(request_ids))
        self.response = response
        self.request_ids = request_ids


# Large events (a video in base64) are written in pieces: a client that reads slowly then holds one piece of ours in
# the transport's buffer, not a copy of the whole event (daemon/connections.py cuts one that reads nothing).
WRITE_PIECE = 1 << 20


async def send(response: web.StreamResponse, data: bytes, request_ids: list[str]) -> None:
    try:
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE):
            await response.write(view[start : start + WRITE_PIECE])
    except ConnectionError:
        raise ClientGone(response, request_ids) from None


# Where an event's JSON holds BLOB (random per process: no client can send it), `send_event` writes a file in base64.
BLOB = "blob-" + secrets.token_hex(16)
# File bytes per base64 piece: a multiple of 3, so that the pieces join into one base64 string.
BLOB_PIECE = WRITE_PIECE // 4 * 3


async def send_event(
    response: web.StreamResponse,
    name: str,
    data: dict,
    request_ids: list[str],
    blob: bytes | None = None,
    event_id: int | None = None,
) -> None:
    """One SSE event (with `event_id`, its `id:` line). With `blob` (an image or a video file), `data` holds BLOB
    once, where the file goes in base64, encoded a piece at a time as it is written: a client that reads slowly makes
    its handler hold the file and one piece, never the file's base64 whole."""
    encoded = sse_event(name, data, event_id)
    if blob is None:
        return await send(response, encoded, request_ids)
    head, mark, tail = encoded.partition(b'"' + BLOB.encode() + b'"')
    assert mark, "send_event: a blob without its place in the event"
    view = memoryview(blob)
    try:
        await response.write(head + b'"')
        for start in range(0, len(view), BLOB_PIECE):
            await response.write(base64.b64encode(view[start : start + BLOB_PIECE]))
        await response.write(b'"' + tail)
    except ConnectionError:
        raise ClientGone(response, request_ids) from None


async def finish(response: web.StreamResponse, request_ids: list[str]) -> None:
    try:
        await response.write_eof()
    except ConnectionError:
        raise ClientGone(response, request_ids) from None


# `handed_on`: the generators that carry a request's events (Engine's mailbox -> ServerState.track -> with_keepalive
# -> a route, or -> a native stream's pump, daemon/native_api.py) yield each event without a name of their own left
# bound to it (`yield held.pop()`): a route that stalls on a client that reads nothing has encoded the finished image
# or clip and dropped it, and only the encoded file stays (a float32 clip of 81 x 832 x 480 is 390 MB; a native
# stream keeps that file for its clients, daemon/replay.py).


async def with_keepalive(events: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """`events`, with a None whenever `every` seconds pass without one (the caller writes an SSE comment, so that
    proxies do not cut a stream that waits in the queue). Closes `events` when done."""
    it = aiter(events)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            if not (await asyncio.wait({pending}, timeout=every))[0]:
                yield None
                continue
            try:
                held = [pending.result()]
            except StopAsyncIteration:
                return
            pending = None
            yield held.pop()  # kept nowhere here while the consumer works (see `handed_on`)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def encode_off_loop(request: web.Request, fn: Callable[..., T], *args) -> T:
    """Image encoding in the encoder pool (`image_encoding.encoder_pool`), timed as the encode_response stage."""
    return await run_encoder(request.app, fn, *args)


async def encode_small(
    request: web.Request, image: np.ndarray, fmt: str, quality: int | None = None, opaque: bool = False
) -> bytes:
    """An image (a native preview at latent resolution, or a small result) encoded in place on the event loop when it
    is small enough that the hop to the encoder pool and back costs more than the work; larger ones go to the pool
    (`encode_off_loop`). Measured on 2 cores, tiny SD3 at 256x256 (its previews 32x32, 0.05 ms each to encode): the
    8 previews of a step reached their clients 4-13 ms after the step through the pool, its threads waiting on the
    GIL that the step thread and the loop pass between them; tiny SD 1.5's 64x64 results, 8 finishing together:
    4.5 ms each through the pool (encode_response), 0.35 ms in place."""
    if image.shape[0] * image.shape[1] > INLINE_PIXELS:
        return await encode_off_loop(request, encode_image, image, fmt, quality, opaque)
    t0 = time.perf_counter()
    data = encode_image(image, fmt, quality, opaque)
    request.app[METRICS].stage_seconds.labels("encode_response").observe(time.perf_counter() - t0)
    return data


async def run_encoder(app: web.Application, fn: Callable[..., T], *args) -> T:
    """`encode_off_loop` for work that outlives its HTTP request (video jobs)."""
    t0 = time.perf_counter()
    data = await asyncio.get_running_loop().run_in_executor(app[ENCODERS], fn, *args)
    app[METRICS].stage_seconds.labels("encode_response").observe(time.perf_counter() - t0)
    return data


async def check_images(request: web.Request, images: dict[str, bytes | Sequence[bytes] | None]) -> None:
    """Each input image (a field's file, or its list of files) decoded once in the encoder pool, off the event loop
    and off the step thread, which then takes the decoded image (models/inputs.py `ADMITTED`): a file too large,
    broken or of a mode we do not take is a 400 naming its field (ParamError), before anything is queued."""
    limit = request.app[STATE].config.max_image_bytes
    files = [(p, d) for p, v in images.items() if v is not None for d in ([v] if isinstance(v, bytes) else v)]
    total = 0
    for param, data in files:
        total += len(data)
        if total > limit:
            message = f"{param} brings the request's images to {total} bytes; this server takes at most {limit} "
            raise ParamError(param, message + "per request, all images together (--max-image-bytes)")
    engine = request.app[STATE].engine
    max_pixels = input_pixel_limit(engine.limits.max_pixels if engine is not None and engine.limits else None)
    pool = request.app[ENCODERS]
    for param, data in files:
        await asyncio.get_running_loop().run_in_executor(pool, admit_image, data, param, max_pixels)


# Words of the prompt the model does not know (a checkpoint that declares its vocabulary): they are drawn as if
# absent, so the client is told, never refused. Comma-separated in this header on both APIs, and a list in the native
# stream's `queued` and `completed` events.
UNKNOWN_WORDS_HEADER = "X-Unknown-Words"
# Set on an answer whose every image came from the result cache (engine/result_cache.py).
CACHE_HEADER = "X-Diffusiond-Cache"


def unknown_words(engine: Engine, prompt: str) -> list[str]:
    from diffusiond.models.declared import unknown_words as unknown

    return unknown(engine.adapter.capabilities.vocabulary, prompt)


async def last_event(events: AsyncIterator[Event]) -> Event:
    last = None
    async for event in events:
        last = event
    assert last is not None
    return last


def terminal_error(event: Event) -> ApiError:
    """Failed events carry a message meant for clients (with the request id); details are in the server log."""
    if isinstance(event, Cancelled):
        return ApiError(
            503, f"request {event.request_id} cancelled: {event.reason}", type="server_error", code="cancelled"
        )
    message = event.error if isinstance(event, Failed) else "no result"
    if isinstance(event, Failed) and event.retry:
        return NotStarted(f"not started: {message}; send it again")
    return ApiError(500, f"generation failed: {message}", type="server_error", code="generation_failed")


def sse_event(event: str, data: dict, event_id: int | None = None) -> bytes:
    """One event; its `id:` (daemon/replay.py) goes last, so that a parser that reads `event:` then `data:` (as the
    native stream had them before it had ids) reads it as before."""
    tail = b"\n\n" if event_id is None else b"\nid: %d\n\n" % event_id
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + tail


async def start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
    )
    await response.prepare(request)
    return response
