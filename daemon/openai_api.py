"""OpenAI Images API: `POST /v1/images/generations` and `POST /v1/images/edits`, non-streaming and streaming with
real partial images."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from diffusiond.daemon.admission import queue_requests
from diffusiond.daemon.api import (
    ApiError,
    Arguments,
    ImageEditRequest,
    ImageGenerationRequest,
    Loras,
    convert_fields,
    decode_body,
    json_fields,
    parse_size,
    validate_openai,
)
from diffusiond.daemon.auth import TENANT, tenant_of
from diffusiond.daemon.edge import read_body, read_form
from diffusiond.daemon.files import store_result
from diffusiond.daemon.handover import carried_ids, hand_over
from diffusiond.daemon.idempotency import KEYS, fingerprint, started
from diffusiond.daemon.image_encoding import answer_images, encode_preview
from diffusiond.daemon.state import STATE, ServerState
from diffusiond.daemon.streaming import (
    BLOB,
    CACHE_HEADER,
    KEEPALIVE,
    UNKNOWN_WORDS_HEADER,
    check_images,
    encode_off_loop,
    encode_small,
    finish,
    last_event,
    send,
    send_event,
    sse_event,
    start_sse,
    terminal_error,
    unknown_words,
    with_keepalive,
)
from diffusiond.engine.engine import Engine, RequestHandle
from diffusiond.engine.outputs import Cancelled, Completed, Event, Failed, Preview
from diffusiond.models.base import Capabilities
from diffusiond.models.params import MAX_REFERENCES, MAX_SEED, ParamError, SamplingParams, params_from

Files = dict[str, list[bytes]]


def _partial_every(steps: int, partial_images: int) -> int:
    """The widest preview spacing that still yields `partial_images` previews before the final step."""
    return max(1, (steps - 1) // partial_images) if partial_images else 0


def parse_image_generation(data: bytes, max_n: int) -> tuple[ImageGenerationRequest, SamplingParams]:
    """The body of `POST /v1/images/generations`, validated as far as it can be without the model (ApiError)."""
    body = decode_body(data, ImageGenerationRequest)
    validate_openai(body, max_n)
    return body, _params(body)


def _honoured(asked: str | None, applied: str | None) -> bool:
    """Whether OpenAI's `quality` (low, medium, high) was the preset the request ran."""
    from diffusiond.models.stepcache.settings import quality_level

    return asked in ("low", "medium", "high") and applied == quality_level(asked)


def _params(body: ImageGenerationRequest, **files: Any) -> SamplingParams:
    """The body's parameters (its fields of the same names), its `size` as width and height, and an edit's files."""
    width, height = parse_size(body.size)
    return params_from(msgspec.structs.asdict(body), width=width, height=height, **files)


IMAGE_PARTS = ("image", "image[]")


async def read_image_edit(request: web.Request, max_n: int, max_image_bytes: int) -> tuple[ImageEditRequest, Files]:
    """The multipart body of `POST /v1/images/edits`: its text fields validated as far as they can be without the
    model, and its files by name ("image" for `image` or `image[]`, and "mask"), unchecked (ApiError)."""
    if request.content_type != "multipart/form-data":
        raise ApiError(
            400,
            f"POST /v1/images/edits takes multipart/form-data with the image as a file, not {request.content_type}",
            param="image",
            code="invalid_content_type",
        )
    # The image, with up to MAX_REFERENCES more (families that take references), and an optional mask.
    limits = {"image": 1 + MAX_REFERENCES, "mask": 1}
    fields, files = await read_form(request, limits, max_image_bytes, aliases=dict.fromkeys(IMAGE_PARTS, "image"))
    if not files["image"]:
        raise ApiError(400, "image is required: the file to edit", param="image")
    body = convert_fields(json_fields(fields, {"lora": Loras, "arguments": Arguments}), ImageEditRequest)
    validate_openai(body, max_n)
    if body.input_fidelity is not None:
        raise ApiError(
            400,
            "input_fidelity is not served: how much of the image an edit keeps is `strength` (0-1, lower keeps more; "
            "image-to-image families), and instruction edits keep what the prompt does not change",
            param="input_fidelity",
        )
    return body, files


# What a model other than an image model makes, and the routes that make it.
OTHER_ROUTES = {
    "video": ("a video model", "POST /v1/videos (OpenAI's Videos API) or POST /v1/generations (the native stream, "
              "with num_frames and fps)"),
    "audio": ("a sound model", "POST /v1/audio/generations (a job) or POST /v1/generations (the native stream, with "
              "audio_format)"),
}  # fmt: skip


def refuse_non_images(engine: Engine) -> None:
    """The Images API makes images; a video model's clips and a sound model's sound have routes of their own."""
    other = OTHER_ROUTES.get(engine.adapter.capabilities.modality)
    if other is not None:
        raise ApiError(
            400,
            f"this server serves {other[0]}, and the Images API makes images: use {other[1]}",
            param="model",
            code="unsupported_model",
        )


def expand(engine: Engine, body: ImageGenerationRequest, base: SamplingParams) -> list[SamplingParams]:
    """The `n` requests of one OpenAI request: resolved against the model and the limits once, each image checked
    against the wire once (ParamError). Queue them `checked`."""
    try:
        resolved = engine.resolve(base)
        assert resolved.seed is not None
        every = _partial_every(resolved.steps_to_run or 1, body.partial_images or 0)
        # Seeds stay within the wire's bounds; preview_every is at most the step count. The copies differ from the
        # first only in a seed within those bounds: the first is wire-checked (its images encoded) once for all.
        first = engine.check_wire(msgspec.structs.replace(resolved, preview_every=every))
        return [
            msgspec.structs.replace(first, seed=(first.seed + i) % (MAX_SEED + 1)) if i else first
            for i in range(body.n or 1)
        ]
    except ParamError as exc:
        if exc.param in ("width", "height"):
            # OpenAI clients send `size`, not width and height.
            raise ParamError("size", str(exc)) from None
        raise


async def images_generations(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    data = await read_body(request, state.config.max_body_bytes)
    body, base = parse_image_generation(data, state.config.max_n)
    digest = fingerprint(request.path, data)
    return await request.app[KEYS].once(
        request, request[TENANT], digest, lambda: _images(request, state, body, base, "image_generation")
    )


async def images_edits(request: web.Request) -> web.StreamResponse:
    """OpenAI edits: the request starts from its image (img2img), with `strength` (ours) of the schedule; with a
    `mask`, only its transparent pixels are repainted (inpainting); families that edit by instruction take no
    strength."""
    state = request.app[STATE]
    body, files = await read_image_edit(request, state.config.max_n, state.config.max_image_bytes)
    engine = state.require_engine()
    refuse_non_images(engine)
    if files["mask"] and "mask" not in engine.adapter.capabilities.image_inputs:
        raise ApiError(400, "this model edits whole images; it takes no mask", param="mask")
    image, *references = files["image"]
    if references and "references" not in engine.adapter.capabilities.image_inputs:
        raise ApiError(400, "this model edits one image per request; send one image", param="image")
    mask = files["mask"][0] if files["mask"] else None
    await check_images(request, {"image": image, "mask": mask, "reference_images": references})
    params = _params(body, image=image, mask=mask, reference_images=tuple(references) or None)
    digest = fingerprint(request.path, msgspec.json.encode(body), *(f for name in sorted(files) for f in files[name]))
    return await request.app[KEYS].once(
        request, request[TENANT], digest, lambda: _images(request, state, body, params, "image_edit")
    )


async def _images(
    request: web.Request, state: ServerState, body: ImageGenerationRequest, base: SamplingParams, kind: str
) -> web.StreamResponse:
    """Generations and edits alike: `n` requests, answered at once or streamed as `{kind}.partial_image` and
    `{kind}.completed` events."""
    engine = state.require_engine()
    refuse_non_images(engine)
    state.model_named(body.model)
    many = expand(engine, body, base)  # before anything is queued
    resolved = many[0]
    partial = body.partial_images or 0
    # OpenAI clients: no progress events.
    ids = carried_ids(request, len(many))
    handles = queue_requests(
        engine, state, many, tenant=tenant_of(request), progress=False, checked=True, ids=ids, priority=body.priority,
        cacheable=body.seed is not None, deadline_ms=body.deadline_ms,
    )  # fmt: skip
    fmt = body.output_format or "png"
    background = _background(body, fmt, engine.adapter.capabilities)
    meta = {
        "size": f"{resolved.width}x{resolved.height}",
        # Echoed only where honoured: a step cache ran the preset it names (models/stepcache/settings.py).
        "quality": body.quality if _honoured(body.quality, resolved.quality) else "auto",
        "background": background,
        "output_format": fmt,
    }
    out = (fmt, body.output_compression, background == "opaque")
    layered = engine.adapter.capabilities.layers  # each layer an image of the answer (Qwen-Image-Layered)
    headers = {"X-Request-Id": ",".join(h.request_id for h in handles)}
    if unknown := unknown_words(engine, resolved.prompt):
        headers[UNKNOWN_WORDS_HEADER] = ", ".join(unknown)
    if body.stream:
        started(request, [h.request_id for h in handles])
        return await _openai_stream(request, state, handles, out, partial, meta, headers, kind, layered)
    # Non-streaming: nothing to write until the end, so a client that hangs up is noticed through handler
    # cancellation (aiohttp), which cancels the requests through `track`.
    results = await asyncio.gather(*(last_event(state.track(h)) for h in handles))
    unfinished = [r for r in results if not isinstance(r, Completed)]
    if unfinished:
        # Not started at all (each a retry): NotStarted, which the next rank 0 may serve (daemon/handover.py).
        raise terminal_error(min(unfinished, key=lambda r: isinstance(r, Failed) and r.retry))
    images = [await encode_small(request, image, *out) for r in results for image in answer_images(r.image, layered)]
    if all(r.cached for r in results):  # every image from the result cache (engine/result_cache.py)
        headers[CACHE_HEADER] = "hit"
    if body.response_format == "url":
        data = [{"url": await store_result(request, img, fmt)} for img in images]
    else:
        data = [{"b64_json": base64.b64encode(img).decode()} for img in images]
    payload = {
        "created": int(time.time()),
        "data": data,
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
    """Events of several requests as they come, tagged with the request's index. The pumps read every mailbox
    whatever the client does, and their queue is bounded by the events the engine produces (previews coalesce)."""
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
            held = [await queue.get()]
            if held[0][1] is None:
                remaining -= 1
            else:
                yield held.pop()  # kept nowhere here while the consumer works (streaming.py: `handed_on`)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _background(body: ImageGenerationRequest, fmt: str, caps: Capabilities) -> str:
    """What the images' background is (the answer's `background`): "transparent" where the model's images have an
    alpha channel (Qwen-Image 2.1's VAE decodes RGBA) and the request leaves it (`auto`) or asks for it, in a format
    that keeps it; else "opaque" (an RGBA image then composited over white). `transparent` from a model without
    alpha, or as JPEG: a 400 naming the field."""
    asked = body.background or "auto"
    if asked == "transparent":
        if not caps.alpha:
            raise ApiError(
                400,
                f"background 'transparent': this model's images have no alpha channel ({caps.family} makes RGB "
                "images); use 'auto' or 'opaque'",
                param="background",
            )
        if fmt == "jpeg":
            raise ApiError(
                400,
                "background 'transparent' needs output_format png or webp: jpeg has no alpha",
                param="output_format",
            )
    if asked == "opaque" or not caps.alpha or fmt == "jpeg":
        return "opaque"
    return "transparent"


async def _openai_stream(request, state, handles, out, partial, meta, headers, kind, layered) -> web.StreamResponse:
    """`out`: the images' format, compression and whether they are made opaque (`_background`); `layered`: each
    request answers one image per layer, a `completed` event each (tagged with its `layer`)."""
    fmt, compression, _ = out
    response = await start_sse(request, headers)
    width, height = (int(v) for v in meta["size"].split("x"))
    sent = [0] * len(handles)
    told = False  # whether the client has had a result or an error
    ids = [h.request_id for h in handles]
    async with contextlib.aclosing(with_keepalive(_merged(state, handles), state.config.sse_keepalive)) as items:
        async for item in items:
            if item is None:
                await send(response, KEEPALIVE, ids)
                continue
            i, event = item
            # Our extension, as in the native stream: which request (of n) the event belongs to.
            tag = {"id": event.request_id, "index": i}
            if isinstance(event, Preview) and sent[i] < partial:
                data = await encode_off_loop(request, encode_preview, event.image, (width, height), fmt, compression)
                name = f"{kind}.partial_image"
                payload = {
                    "type": name,
                    "b64_json": base64.b64encode(data).decode(),
                    "partial_image_index": sent[i],
                    "created_at": int(time.time()),
                    **meta,
                    **tag,
                }
                await send(response, sse_event(name, payload), ids)
                sent[i] += 1
            elif isinstance(event, Completed):
                images = answer_images(event.image, layered)
                item = event = None  # the image is let go before its file waits on the client
                name = f"{kind}.completed"
                payload = {"type": name, "b64_json": BLOB, "created_at": int(time.time()), **meta, "usage": _usage()}
                for j in range(len(images)):
                    data = await encode_small(request, images[j], *out)
                    images[j] = None
                    await send_event(response, name, {**payload, **tag, **({"layer": j} if layered else {})}, ids, data)
                told = True
            elif isinstance(event, Cancelled | Failed):
                error = {"type": "error", **terminal_error(event).body()}
                data = sse_event("error", {**error, **tag})
                if isinstance(event, Failed) and event.retry and not any(sent) and not told:
                    # The client has the stream's head only: the next rank 0 goes on with it (daemon/handover.py).
                    errors = [sse_event("error", {**error, "id": rid, "index": j}) for j, rid in enumerate(ids)]
                    if await hand_over(request, b"".join(errors), ids, response):
                        return response
                await send(response, data, ids)
                told = True
    await finish(response, ids)
    return response
