"""The native API: `POST /v1/generations` (an SSE stream of everything the engine knows about one request), and
status and cancellation by id."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
from collections.abc import Callable

import msgspec
from aiohttp import web

from diffusiond.daemon.admission import queue_requests
from diffusiond.daemon.api import ApiError, GenerationRequest, body_limit, decode_body
from diffusiond.daemon.audio_encoding import completed_sound, encode_sound
from diffusiond.daemon.auth import TENANT, tenant_of
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.connections import CONNECTIONS
from diffusiond.daemon.edge import read_body
from diffusiond.daemon.files import store_result
from diffusiond.daemon.handover import carried_ids, hand_over
from diffusiond.daemon.idempotency import KEYS, fingerprint, started
from diffusiond.daemon.replay import REPLAYS, Frame, Replay, last_event_id
from diffusiond.daemon.state import IN_FLIGHT, STATE, Record
from diffusiond.daemon.streaming import (
    BLOB,
    UNKNOWN_WORDS_HEADER,
    check_images,
    encode_off_loop,
    encode_small,
    finish,
    sse_event,
    start_sse,
    unknown_words,
)
from diffusiond.daemon.video_encoding import EncodedVideo, encode_video
from diffusiond.daemon.videos_api import stored_record
from diffusiond.engine.engine import RequestHandle
from diffusiond.engine.outputs import (
    Cancelled,
    Completed,
    Event,
    Failed,
    Latent,
    Paused,
    Preview,
    Progress,
    Queued,
    Resumed,
)
from diffusiond.models.params import SamplingParams, params_from

log = logging.getLogger(__name__)


def native_limit(config: ServeConfig) -> int:
    """The largest native body: it may carry an image, its mask and its reference images in base64 (together at most
    --max-image-bytes)."""
    return body_limit(config.max_body_bytes, config.max_image_bytes)


def parse_generation(data: bytes) -> tuple[GenerationRequest, SamplingParams]:
    """The body of `POST /v1/generations`, validated as far as it can be without the model (ApiError: 400)."""
    body = decode_body(data, GenerationRequest)
    if body.output_format not in ("png", "jpeg", "webp"):
        raise ApiError(
            400, f"output_format must be png, jpeg or webp; got {body.output_format!r}", param="output_format"
        )
    if body.stream_latents and not body.preview_every:
        raise ApiError(400, "latents are streamed with previews: set preview_every > 0", param="latents")
    params = params_from(msgspec.structs.asdict(body))  # the body's fields are the parameters
    return body, params


async def generations(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    data = await read_body(request, native_limit(state.config))
    body, params = parse_generation(data)
    digest = fingerprint(request.path, data)
    # The same POST again (its Idempotency-Key) while its stream is kept: it goes on from Last-Event-ID.
    for rid in request.app[KEYS].stream_of(request, request[TENANT], digest):
        if (replay := request.app[REPLAYS].get(rid, request[TENANT])) is not None:
            return await _follow(request, replay)
    return await request.app[KEYS].once(request, request[TENANT], digest, lambda: _generate(request, body, params))


async def generation_events(request: web.Request) -> web.StreamResponse:
    """`GET /v1/generations/{id}/events`: a native stream's events, to a client that comes back with `Last-Event-ID`
    (or any other client of its tenant), within the window (daemon/replay.py)."""
    rid = request.match_info["id"]
    replay = request.app[REPLAYS].get(rid, request[TENANT])
    if replay is None:
        rec = await _get_record(request)  # 404 for an id this tenant never made
        window = request.app[STATE].config.reconnect_window
        raise ApiError(
            404,
            f"generation {rid} ({rec.status}) has no events kept: they are kept for native streams "
            f"(POST /v1/generations), up to {window:g} s after the stream ends or its client leaves "
            f"(--reconnect-window); GET /v1/generations/{rid} reports its status",
            param="id",
            code="events_not_kept",
        )
    return await _follow(request, replay)


async def _follow(request: web.Request, replay: Replay) -> web.StreamResponse:
    after = last_event_id(request)
    response = await start_sse(request, {"X-Request-Id": replay.request_id})
    if await replay.follow(response, after, request.app[STATE].config.sse_keepalive, cut=_was_cut(request)):
        await finish(response, [replay.request_id])
    return response


async def _generate(request: web.Request, body: GenerationRequest, params: SamplingParams) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.require_engine()
    caps = engine.adapter.capabilities
    # "layers": images, several a request (Qwen-Image-Layered).
    modality = "layers" if caps.layers else caps.modality
    video = modality == "video"
    if body.video_format is not None and not video:
        raise ApiError(400, f"video_format is for video models; this model makes {modality}", param="video_format")
    if body.audio_format is not None and modality != "audio":
        raise ApiError(400, f"audio_format is for sound models; this model makes {modality}", param="audio_format")
    await check_images(request, {"image": body.image, "mask": body.mask, "reference_images": body.reference_images})
    # add_request checks it (Engine.check)
    (handle,) = queue_requests(
        engine, state, [params], tenant=tenant_of(request), ids=carried_ids(request, 1), priority=body.priority,
        cacheable=body.seed is not None, deadline_ms=body.deadline_ms,
    )  # fmt: skip
    started(request, [handle.request_id])
    unknown = unknown_words(engine, params.prompt)
    headers = {"X-Request-Id": handle.request_id}
    if unknown:
        headers[UNKNOWN_WORDS_HEADER] = ", ".join(unknown)
    told = {"unknown_words": unknown} if unknown else {}
    rid = handle.request_id
    response = await start_sse(request, headers)
    replay = Replay(rid, request[TENANT], state.config.reconnect_window)
    request.app[REPLAYS].start(replay, _pump(request, body, handle, told, modality, replay))

    async def hand_on(frame: Frame) -> bool:  # a request not started by a failing group: the next rank 0's
        return await hand_over(request, sse_event(frame.name, frame.data), [rid], response)

    if await replay.follow(response, 0, state.config.sse_keepalive, hand_on, _was_cut(request)):
        await finish(response, [rid])
    return response


def _was_cut(request: web.Request) -> Callable[[], bool]:
    """Whether the server cut `request`'s connection for reading nothing (its stream is then not kept for a return)."""
    return functools.partial(request.app[CONNECTIONS].was_cut, request)


async def _pump(
    request: web.Request, body: GenerationRequest, handle: RequestHandle, told: dict, modality: str, replay: Replay
) -> None:
    """The request's events, rendered and kept for its clients (`Replay.follow`), whether or not one is connected."""
    rid = handle.request_id
    try:
        async with contextlib.aclosing(request.app[STATE].track(handle)) as events:
            async for event in events:
                name, data, blob = await _render(request, body, handle, event, told, modality)
                event = None  # a finished image or clip is let go once encoded (streaming.py: `handed_on`)
                replay.add(name, {"type": name, "id": rid, **data}, blob)
    except asyncio.CancelledError:  # no client came back within the window (track cancels it), or a shutdown
        if not replay.ended:
            replay.add("cancelled", {"type": "cancelled", "id": rid, "reason": "its client went away"})
        raise
    except ApiError as exc:  # its result could not be kept (a tenant's quota, a full store): the client is told why
        log.info("request %s: %s", rid, exc)
        if not replay.ended:
            replay.add("failed", {"type": "failed", "id": rid, "error": str(exc), "code": exc.code})
    except Exception:
        log.exception("request %s: its stream failed", rid)
        if not replay.ended:
            error = "internal error while sending its events; details are in the server log"
            replay.add("failed", {"type": "failed", "id": rid, "error": error})


async def _render(
    request: web.Request, body: GenerationRequest, handle: RequestHandle, event: Event, told: dict, modality: str
) -> tuple[str, dict, bytes | None]:
    """An event of the stream: its name, its data, and the file that goes where the data holds BLOB."""
    if isinstance(event, Queued):
        return "queued", {"position": event.position, **told}, None
    if isinstance(event, Progress):
        return "progress", {"step": event.step, "total": event.total}, None
    if isinstance(event, Paused | Resumed):  # preempted by a higher class, and back (engine/scheduler.py)
        return type(event).__name__.lower(), {"step": event.step, "total": event.total}, None
    if isinstance(event, Preview):
        data = await encode_small(request, event.image, body.output_format)
        preview = {"step": event.step, "total": event.total, "format": body.output_format}
        size = {"width": event.image.shape[1], "height": event.image.shape[0]}
        return "preview", {**preview, **size, "b64": base64.b64encode(data).decode()}, None
    if isinstance(event, Latent):
        latent = {"dtype": str(event.latent.dtype), "shape": list(event.latent.shape)}
        b64 = base64.b64encode(event.latent.tobytes()).decode()
        return "latent", {"step": event.step, "total": event.total, **latent, "b64": b64}, None
    by_url = body.response_format == "url"
    # Served from the result cache (engine/result_cache.py): said in every form a result takes.
    cached = {"cached": True} if isinstance(event, Completed) and event.cached else {}
    if isinstance(event, Completed) and modality == "audio":
        encoded = await encode_off_loop(request, encode_sound, completed_sound(event), body.audio_format or "wav")
        payload = {k: getattr(encoded, k) for k in ("format", "sample_rate", "channels", "samples")}
        if by_url:
            payload["url"] = await store_result(request, encoded.data, encoded.format)
            return "completed", {"seed": event.seed, "audio": payload, **cached, **told}, None
        return "completed", {"seed": event.seed, "audio": {**payload, "b64": BLOB}, **cached, **told}, encoded.data
    if isinstance(event, Completed) and modality == "video":
        fmt = body.video_format or "mp4"
        clip = await encode_off_loop(request, encode_video, event.image, handle.params.fps, fmt, None, event.audio)
        payload = video_payload(clip)
        if by_url:
            del payload["b64"]
            payload["url"] = await store_result(request, clip.data, clip.format)
        return "completed", {"seed": event.seed, "video": payload, **cached, **told}, None if by_url else clip.data
    if isinstance(event, Completed) and modality == "layers":  # one image per layer, in order
        files = [await encode_small(request, layer, body.output_format) for layer in event.image]
        if by_url:
            images = [
                {"format": body.output_format, "url": await store_result(request, f, body.output_format)} for f in files
            ]
        else:
            images = [{"format": body.output_format, "b64": base64.b64encode(f).decode()} for f in files]
        return "completed", {"seed": event.seed, "images": images, **cached, **told}, None
    if isinstance(event, Completed):
        data = await encode_small(request, event.image, body.output_format)
        if by_url:
            images = [{"format": body.output_format, "url": await store_result(request, data, body.output_format)}]
            return "completed", {"seed": event.seed, "images": images, **cached, **told}, None
        images = [{"format": body.output_format, "b64": BLOB}]
        return "completed", {"seed": event.seed, "images": images, **cached, **told}, data
    if isinstance(event, Cancelled):
        return "cancelled", {"reason": event.reason}, None
    assert isinstance(event, Failed)
    return "failed", {"error": event.error, **({"retry": True} if event.retry else {})}, None


def video_payload(clip: EncodedVideo) -> dict:
    """The `video` of a completed event: what the file holds, and BLOB where the file goes in base64."""
    out = {
        "format": clip.format,
        "b64": BLOB,
        "fps": clip.fps,
        "num_frames": clip.num_frames,
        "width": clip.width,
        "height": clip.height,
    }
    if clip.fallback is not None:
        out["format_fallback"] = clip.fallback
    if clip.sample_rate is not None:
        out["audio_sample_rate"] = clip.sample_rate
    return out


async def _get_record(request: web.Request) -> Record:
    """A request's record: this process's, else the job database's (`--state-dir`, `--state-url`): one a previous
    run of this replica or another replica made."""
    request_id = request.match_info["id"]
    rec = request.app[STATE].owned(request_id, request[TENANT])
    if rec is None and (stored := await stored_record(request.app, request_id)) is not None:
        rec = stored if stored.owner == request[TENANT] else None
    if rec is None:
        raise ApiError(404, f"no generation with id {request_id!r}", param="id", code="not_found")
    return rec


async def generation_status(request: web.Request) -> web.Response:
    rec = await _get_record(request)
    engine = request.app[STATE].engine
    if rec.status in ("queued", "running") and engine is not None:  # a paused one reports where it stopped
        # Requests without progress events (the OpenAI routes) and streams behind their readers: the step count
        # comes from the engine itself.
        step = engine.steps_done.get(rec.id)
        if step is not None and step >= rec.step:
            rec.status, rec.step = "running", step
    return web.json_response(msgspec.to_builtins(rec))


async def generation_cancel(request: web.Request) -> web.Response:
    rec = await _get_record(request)
    state = request.app[STATE]
    if rec.status in IN_FLIGHT and rec.id not in state.records:
        raise ApiError(
            409,
            f"generation {rec.id} runs on another replica; cancel it there, or close its stream",
            param="id",
            code="not_here",
        )
    if rec.status in IN_FLIGHT and state.engine is not None:
        state.engine.cancel(rec.id)
        return web.json_response({**msgspec.to_builtins(rec), "cancel_requested": True}, status=202)
    raise ApiError(
        409,
        f"generation {rec.id} is already {rec.status}; there is nothing to cancel",
        param="id",
        code="already_finished",
    )
