"""The aiohttp application: OpenAI Images API, the native SSE API, health, readiness and model listing.

The model loads in the background after the socket is up, so `/health` answers at once and `/ready` says 503 until
the model is loaded and warmed up. Every error is OpenAI-shaped (`daemon/api.py`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from diffusiond import __version__
from diffusiond.daemon.api import (
    ApiError,
    GenerationRequest,
    ImageGenerationRequest,
    decode_body,
    parse_size,
    validate_openai,
)
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.images import encode_image, encode_preview
from diffusiond.engine.comm import Communicator
from diffusiond.engine.engine import Engine, QueueFullError, RequestHandle
from diffusiond.engine.outputs import Cancelled, Completed, Event, Failed, Latent, Preview, Progress, Queued
from diffusiond.engine.request import SamplingParams
from diffusiond.metrics.loop_lag import watch_loop_lag
from diffusiond.metrics.observer import PrometheusObserver
from diffusiond.metrics.registry import Metrics
from diffusiond.models.base import ModelAdapter, ParamError

log = logging.getLogger(__name__)

MAX_RECORDS = 4096


@dataclass
class Record:
    """What `GET /v1/generations/{id}` reports."""

    id: str
    created: int
    status: str = "queued"
    step: int = 0
    total: int = 0
    error: str | None = None


@dataclass
class ServerState:
    config: ServeConfig
    model_id: str = ""
    engine: Engine | None = None
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    # Set once loading ended, ready or failed (`serve.py` then notifies the service manager).
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    records: OrderedDict[str, Record] = field(default_factory=OrderedDict)
    _settling: set[asyncio.Task] = field(default_factory=set)

    def require_engine(self) -> Engine:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable")
        if self.engine is None or not self.ready:
            reason = f"model failed to load: {self.load_error}" if self.load_error else "model is still loading"
            raise ApiError(503, reason, type="server_error", code="unavailable", headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise ApiError(503, f"engine stopped: {self.engine.error!r}", type="server_error", code="unavailable")
        return self.engine

    def record(self, handle: RequestHandle) -> Record:
        rec = Record(handle.request_id, int(time.time()), total=handle.params.num_inference_steps or 0)
        self.records[rec.id] = rec
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)
        return rec

    async def track(self, handle: RequestHandle) -> AsyncIterator[Event]:
        """A request's events, keeping its record current; cancels the request if the consumer goes away."""
        rec = self.records.get(handle.request_id) or self.record(handle)
        finished = False
        try:
            async for event in handle.events():
                if isinstance(event, Progress):
                    rec.status, rec.step = "running", event.step
                elif isinstance(event, Completed):
                    rec.status, rec.step = "completed", rec.total
                elif isinstance(event, Cancelled):
                    rec.status, rec.error = "cancelled", event.reason
                elif isinstance(event, Failed):
                    rec.status, rec.error = "failed", event.error
                finished = isinstance(event, Completed | Cancelled | Failed)
                yield event
        finally:
            if not finished:
                # The consumer went away (client disconnect): cancel, and keep the record current until the
                # request's terminal event, which nobody else will read.
                handle.cancel()
                task = asyncio.create_task(self._settle(handle, rec))
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

    @staticmethod
    async def _settle(handle: RequestHandle, rec: Record) -> None:
        event = await handle.result()
        if isinstance(event, Completed):
            rec.status, rec.step = "completed", rec.total
        elif isinstance(event, Cancelled):
            rec.status, rec.error = "cancelled", event.reason
        elif isinstance(event, Failed):
            rec.status, rec.error = "failed", event.error


STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", Metrics)
PRELOADED = web.AppKey("preloaded_adapter", ModelAdapter)
JOIN = web.AppKey("join_group", Callable)


def create_app(
    config: ServeConfig,
    *,
    adapter: ModelAdapter | None = None,
    join: Callable[[], tuple[ModelAdapter, Communicator]] | None = None,
) -> web.Application:
    """`adapter`: a model already loaded (tests). `join`: how rank 0 of an SPMD group joins it and loads its model
    (run in a thread by the loader task, so the loop answers /health and pings the watchdog meanwhile)."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware, auth_middleware])
    app[STATE] = ServerState(config)
    app[METRICS] = Metrics()
    if adapter is not None:
        app[PRELOADED] = adapter
    if join is not None:
        app[JOIN] = join
    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/images/generations", images_generations)
    app.router.add_post("/v1/generations", generations)
    app.router.add_get("/v1/generations/{id}", generation_status)
    app.router.add_delete("/v1/generations/{id}", generation_cancel)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", playground)
    return app


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    loader = asyncio.create_task(_load(app))
    loader.add_done_callback(lambda _: state.loaded.set())
    lag = asyncio.create_task(watch_loop_lag(app[METRICS].loop_lag))
    yield
    state.ready = False
    state.draining = True
    for task in (loader, lag):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if state.engine is not None:
        await state.engine.stop()


async def _load(app: web.Application) -> None:
    state = app[STATE]
    config = state.config
    try:
        adapter = app.get(PRELOADED)
        model = config.model
        comm = None
        if JOIN in app:
            adapter, comm = await asyncio.to_thread(app[JOIN])
        elif adapter is None:
            from diffusiond.models.loader import load_adapter

            if model is None:
                from diffusiond.models.default import default_model

                model = await asyncio.to_thread(default_model)
            adapter = await asyncio.to_thread(load_adapter, model, device=config.device, dtype=config.dtype)
        state.model_id = _model_id(model or getattr(adapter, "source", "model"))
        engine = Engine(
            adapter,
            max_batch=config.max_batch,
            max_waiting=config.max_queue,
            observer=PrometheusObserver(app[METRICS]),
            comm=comm,
        )
        caps = adapter.capabilities
        app[METRICS].set_info(
            model=state.model_id,
            family=caps.family,
            dtype=caps.dtype,
            device=caps.device,
            world_size=engine.comm.world_size,
            version=__version__,
        )
        await engine.start()
        state.engine = engine
        # Warm-up: one smallest, one-step request through the whole path.
        side = adapter.capabilities.size_multiple * 2
        warm = engine.add_request(
            SamplingParams(prompt="warm-up", seed=0, width=side, height=side, num_inference_steps=1)
        )
        result = await warm.result()
        if not isinstance(result, Completed):
            raise RuntimeError(f"warm-up request ended with {result}")
        state.ready = True
        log.info("ready: serving %s (%s)", state.model_id, adapter.capabilities.family)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("model failed to load")


def _model_id(model: str) -> str:
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


# ---- middlewares ----


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except ParamError as exc:
        return ApiError(400, str(exc), param=exc.param, code="invalid_value").response()
    except QueueFullError as exc:
        return ApiError(
            429,
            f"too many requests in flight: {exc}",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ).response()
    except web.HTTPException as exc:
        if exc.status == 413:
            limit = request.app[STATE].config.max_body_bytes
            return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large").response()
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"), headers=headers).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


# Liveness, readiness and scraping stay open when an API key is set (probes and scrapers carry no key).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/"})


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[STATE].config.api_key
    if key and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer KEY')",
                type="invalid_request_error",
                code="invalid_api_key",
            )
    return await handler(request)


# ---- health ----


async def health(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    if engine is not None and engine.error is not None:
        return web.json_response({"status": "engine_failed", "error": repr(engine.error)}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready and not state.draining and state.engine is not None and state.engine.alive:
        return web.json_response({"status": "ready", "model": state.model_id})
    status = "draining" if state.draining else ("failed" if state.load_error else "loading")
    return web.json_response({"status": status, "error": state.load_error}, status=503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format, or OpenMetrics when the scraper asks for it."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = encoder(request.app[METRICS].registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


PLAYGROUND = Path(__file__).parent / "static" / "index.html"


async def playground(request: web.Request) -> web.Response:
    """The playground page: plain HTML and JS, no build step."""
    return web.FileResponse(PLAYGROUND, headers={"Cache-Control": "no-cache"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = []
    if state.model_id:
        entry = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "diffusiond"}
        if state.engine is not None:
            # Our extension (OpenAI clients ignore unknown fields): what a UI needs to offer sensible controls.
            caps = state.engine.adapter.capabilities
            entry["diffusiond"] = {
                "family": caps.family,
                "default_width": caps.default_width,
                "default_height": caps.default_height,
                "default_steps": caps.default_steps,
                "default_guidance": caps.default_guidance,
                "size_multiple": caps.size_multiple,
                "max_side": caps.max_side,
            }
        data.append(entry)
    return web.json_response({"object": "list", "data": data})


# ---- OpenAI Images API ----


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
    handles = _add_all(
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
    results = await asyncio.gather(*(_last(state.track(h)) for h in handles))
    for result in results:
        if not isinstance(result, Completed):
            raise _terminal_error(result)
    images = [await _encode(request, encode_image, r.image, fmt, body.output_compression) for r in results]
    payload = {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(img).decode()} for img in images],
        **{k: v for k, v in meta.items() if k != "quality" or v != "auto"},
        "usage": _usage(),
    }
    return web.json_response(payload, headers=headers, dumps=lambda o: msgspec.json.encode(o).decode())


async def _encode(request: web.Request, fn, *args) -> bytes:
    """Image encoding off the event loop, timed as the encode_response stage."""
    t0 = time.perf_counter()
    data = await asyncio.to_thread(fn, *args)
    request.app[METRICS].stage_seconds.labels("encode_response").observe(time.perf_counter() - t0)
    return data


def _add_all(engine: Engine, state: ServerState, params: list[SamplingParams]) -> list[RequestHandle]:
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


async def _last(events: AsyncIterator[Event]) -> Event:
    last = None
    async for event in events:
        last = event
    assert last is not None
    return last


def _terminal_error(event: Event) -> ApiError:
    if isinstance(event, Cancelled):
        return ApiError(503, f"request cancelled: {event.reason}", type="server_error", code="cancelled")
    message = event.error if isinstance(event, Failed) else str(event)
    return ApiError(500, f"generation failed: {message}", type="server_error", code="generation_failed")


def _usage() -> dict:
    # Diffusion models are not billed in tokens; the fields exist so that OpenAI clients parse the response.
    return {
        "input_tokens": 0,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
        "output_tokens": 0,
        "total_tokens": 0,
    }


def _sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


async def _start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
    )
    await response.prepare(request)
    return response


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
    response = await _start_sse(request, headers)
    width, height = (int(v) for v in meta["size"].split("x"))
    sent = [0] * len(handles)
    async for i, event in _merged(state, handles):
        if isinstance(event, Preview) and sent[i] < partial:
            data = await _encode(request, encode_preview, event.image, (width, height), fmt, compression)
            await response.write(
                _sse(
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
            data = await _encode(request, encode_image, event.image, fmt, compression)
            await response.write(
                _sse(
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
            await response.write(_sse("error", {"type": "error", **_terminal_error(event).body()}))
    await response.write_eof()
    return response


# ---- native API ----


async def generations(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request.read(), GenerationRequest)
    if body.output_format not in ("png", "jpeg", "webp"):
        raise ApiError(
            400, f"output_format must be png, jpeg or webp; got {body.output_format!r}", param="output_format"
        )
    engine = state.require_engine()
    params = SamplingParams(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        seed=body.seed,
        width=body.width,
        height=body.height,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        true_cfg_scale=body.true_cfg_scale,
        preview_every=body.preview_every,
        stream_latents=body.latents,
    )
    if body.latents and not body.preview_every:
        raise ApiError(400, "latents are streamed with previews: set preview_every > 0", param="latents")
    (handle,) = _add_all(engine, state, [engine.adapter.resolve(params)])
    response = await _start_sse(request, {"X-Request-Id": handle.request_id})
    rid = handle.request_id
    async for event in state.track(handle):
        if isinstance(event, Queued):
            out = ("queued", {"position": event.position})
        elif isinstance(event, Progress):
            out = ("progress", {"step": event.step, "total": event.total})
        elif isinstance(event, Preview):
            data = await _encode(request, encode_image, event.image, body.output_format)
            out = (
                "preview",
                {
                    "step": event.step,
                    "total": event.total,
                    "format": body.output_format,
                    "width": event.image.shape[1],
                    "height": event.image.shape[0],
                    "b64": base64.b64encode(data).decode(),
                },
            )
        elif isinstance(event, Latent):
            out = (
                "latent",
                {
                    "step": event.step,
                    "total": event.total,
                    "dtype": str(event.latent.dtype),
                    "shape": list(event.latent.shape),
                    "b64": base64.b64encode(event.latent.tobytes()).decode(),
                },
            )
        elif isinstance(event, Completed):
            data = await _encode(request, encode_image, event.image, body.output_format)
            out = (
                "completed",
                {
                    "seed": event.seed,
                    "images": [{"format": body.output_format, "b64": base64.b64encode(data).decode()}],
                },
            )
        elif isinstance(event, Cancelled):
            out = ("cancelled", {"reason": event.reason})
        else:
            assert isinstance(event, Failed)
            out = ("failed", {"error": event.error})
        await response.write(_sse(out[0], {"type": out[0], "id": rid, **out[1]}))
    await response.write_eof()
    return response


def _get_record(request: web.Request) -> Record:
    rec = request.app[STATE].records.get(request.match_info["id"])
    if rec is None:
        raise ApiError(404, f"no generation with id {request.match_info['id']!r}", param="id", code="not_found")
    return rec


async def generation_status(request: web.Request) -> web.Response:
    return web.json_response(msgspec.to_builtins(_get_record(request)))


async def generation_cancel(request: web.Request) -> web.Response:
    rec = _get_record(request)
    state = request.app[STATE]
    if rec.status in ("queued", "running") and state.engine is not None:
        state.engine.cancel(rec.id)
        return web.json_response({**msgspec.to_builtins(rec), "cancel_requested": True}, status=202)
    return web.json_response({**msgspec.to_builtins(rec), "cancel_requested": False}, status=409)
