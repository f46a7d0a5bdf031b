"""The aiohttp application: OpenAI Images API, the native SSE API, health, readiness and model listing.

The model loads in the background after the socket is up, so `/health` answers at once and `/ready` says 503 until
the model is loaded and warmed up. Every error is OpenAI-shaped (`daemon/api.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from diffusiond import __version__
from diffusiond.daemon import audio_jobs, loras_api, native_api, openai_api, videos_api
from diffusiond.daemon.api import ApiError, retry_later, too_large
from diffusiond.daemon.auth import TENANTS, tenant_middleware
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.connections import CONNECTIONS, PROBES, ConnectionGuard, connection_limit, open_files_limit
from diffusiond.daemon.edge import READ_BUDGET, ReadBudget, edge_middleware
from diffusiond.daemon.field_rules import field_rules
from diffusiond.daemon.handover import CARRIED, carry_over
from diffusiond.daemon.idempotency import KEYS, IdempotencyKeys
from diffusiond.daemon.image_encoding import encoder_pool, gray_png
from diffusiond.daemon.job_db import DatabaseAway
from diffusiond.daemon.jobs_api import add_job_routes
from diffusiond.daemon.listener import served_marker
from diffusiond.daemon.model_document import served_document
from diffusiond.daemon.native_api import native_limit
from diffusiond.daemon.replay import replays_ctx
from diffusiond.daemon.startup import model_setup
from diffusiond.daemon.state import ENCODERS, LOAD, METRICS, STATE, ServerState
from diffusiond.daemon.streaming import ClientGone
from diffusiond.daemon.tenants import TenantBook
from diffusiond.daemon.webhooks import webhooks_ctx
from diffusiond.engine.engine import Engine, Loader, QueueFullError
from diffusiond.engine.outputs import Completed
from diffusiond.engine.step_loop import CONFIG_ERRORS
from diffusiond.metrics.engine_metrics import PrometheusObserver
from diffusiond.metrics.loop_lag import watch_loop_lag
from diffusiond.metrics.registry import Metrics
from diffusiond.models.base import Capabilities, ModelAdapter
from diffusiond.models.loading.setup import SetupError
from diffusiond.models.params import ParamError, RequestLimits, SamplingParams

log = logging.getLogger(__name__)
# How long a request that arrives while a restarted group loads waits for it before it gets 503.
HEAL_WAIT_S = 60.0


def create_app(config: ServeConfig, *, load: Loader | None = None, healing: bool = False) -> web.Application:
    """`load`: how the model is loaded (an SPMD rank 0 joins its group there too; tests pass their checkpoint).
    Default: `config.model`, else the bundled default model. It runs on the engine's step thread, the one thread
    that owns torch in this process; the event loop answers /health and pings the watchdog meanwhile. `healing`:
    this is a group's restart, so requests that arrive while it loads wait for it (up to HEAL_WAIT_S) rather than
    get 503: they were made to the same socket during the heal."""
    guard = ConnectionGuard(connection_limit(config, open_files_limit()), config.write_timeout)
    tenants = TenantBook(config.api_keys_file, config.api_key)
    app = web.Application(
        client_max_size=native_limit(config),  # bodies are read by `edge.read_body`, against their route's limit
        middlewares=[
            error_middleware,
            carry_over,
            guard.middleware(),
            edge_middleware(config),
            tenant_middleware(tenants),
            wait_for_heal,
        ],
    )
    app[CONNECTIONS] = guard
    app[TENANTS] = tenants
    app[KEYS] = IdempotencyKeys()
    app[CARRIED] = {}
    app[METRICS] = Metrics()
    app[METRICS].add_tenants(tenants.current.names())
    app[STATE] = ServerState(config, healing=healing, metrics=app[METRICS])
    app[READ_BUDGET] = ReadBudget(config.max_reading_bytes, config.min_body_rate)
    app[LOAD] = load or _default_loader(config)
    app.cleanup_ctx.append(webhooks_ctx)  # first: it ends last, after the jobs that send its events
    app.cleanup_ctx.append(replays_ctx)  # before the engine's: it ends after, once the engine ended its requests
    app.cleanup_ctx.append(engine_ctx)
    app.cleanup_ctx.append(videos_api.videos_ctx)  # after the engine's: it ends first, while the engine runs
    app.router.add_post("/v1/images/generations", openai_api.images_generations)
    app.router.add_post("/v1/images/edits", openai_api.images_edits)
    app.router.add_post("/v1/generations", native_api.generations)
    app.router.add_get("/v1/generations/{id}", native_api.generation_status)
    app.router.add_get("/v1/generations/{id}/events", native_api.generation_events)
    app.router.add_delete("/v1/generations/{id}", native_api.generation_cancel)
    app.router.add_post("/v1/videos", videos_api.create_video)
    add_job_routes(app.router, "/v1/videos", "video")
    app.router.add_post("/v1/audio/generations", audio_jobs.create_audio)
    add_job_routes(app.router, "/v1/audio/generations", "audio")
    app.router.add_get("/v1/files/{id}/content", videos_api.file_content)
    app.router.add_get("/v1/loras", loras_api.list_loras)
    app.router.add_post("/v1/loras", loras_api.create_lora)
    app.router.add_delete("/v1/loras/{name}", loras_api.delete_lora)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_document)
    app.router.add_get("/", playground)
    return app


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    app[ENCODERS] = encoders = encoder_pool()
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
    encoders.shutdown(wait=False, cancel_futures=True)


def _default_loader(config: ServeConfig) -> Loader:
    def load() -> ModelAdapter:
        from diffusiond.models.loading.setup import build_adapter

        return build_adapter(model_setup(config))

    return load


async def _load(app: web.Application) -> None:
    state = app[STATE]
    config = state.config
    engine = Engine(
        app[LOAD],
        max_batch=config.max_batch,
        max_waiting=config.max_queue,
        observer=PrometheusObserver(app[METRICS]),
        batch_wait=config.batch_wait_ms / 1000,
        result_cache_bytes=config.result_cache_bytes,
    )
    # Before it starts: the scheduler's own settings, and the paused states' budget (engine/parking.py).
    engine.scheduler.aging.steps = config.priority_aging_steps
    engine.scheduler.preemption = config.preemption
    engine.scheduler.short_steps.window_s = config.class_window_ms / 1000
    engine.paused_bytes = config.paused_bytes
    # Set before it loads, so that cleanup stops it whatever happens; routes wait for `ready`.
    state.engine = engine
    try:
        await engine.start()
        adapter = engine.adapter
        caps = adapter.capabilities
        names = config.served_model_name or (caps.name or _model_id(config.model or adapter.source),)
        state.model_id, state.model_names = names[0], tuple(dict.fromkeys(names))
        engine.limits = request_limits(config, caps)
        app[METRICS].lora.source = lambda: adapter.lora_registry
        app[METRICS].result_cache.source = lambda: engine.result_cache
        app[METRICS].set_info(
            model=state.model_id,
            family=caps.family,
            dtype=caps.dtype,
            device=caps.device,
            world_size=engine.comm.world_size,
            version=__version__,
        )
        state.attach(engine)
        marker = served_marker()
        if state.healing and not config.compile and marker is not None and marker.exists():
            # The group served before this heal: the same model and layout warmed up then, and nothing compiled
            # is lost. Clients wait for the heal; the first step after it pays its own first forward.
            log.info("warm-up skipped: a heal of a group that served before")
        else:
            await _warm_up(engine, caps, compiled=config.compile)
        state.ready = True
        if marker is not None:
            marker.touch()
        log.info("ready: serving %s (%s)", state.model_id, caps.family)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        state.config_error = isinstance(exc, CONFIG_ERRORS)
        if engine.error is not exc:  # the step thread logged its own failure with the traceback
            log.exception("model failed to load")


async def _warm_up(engine: Engine, caps: Capabilities, *, compiled: bool) -> None:
    """Through the whole path, not a user request (no metrics, no request log line)."""
    t0 = time.monotonic()
    for group in warm_up_requests(caps, compiled=compiled, limits=engine.limits):
        handles = [engine.add_request(params, internal=True) for params in group]
        for handle in handles:
            result = await handle.result()
            if not isinstance(result, Completed):
                raise RuntimeError(f"warm-up request ended with {result}")
    log.info("warm-up took %.1f s", time.monotonic() - t0)


def warm_up_params(caps: Capabilities, limits: RequestLimits | None = None) -> SamplingParams:
    """The request that warms the model up: the shape most requests will have (the default size, with the default
    guidance, so with CFG where it is on by default), for the fewest steps the model serves (at least 2, so that the
    sampler's step runs too). First calls at a new shape pay for kernel selection and allocation; better here than
    in a user's first request."""
    steps = max(2, caps.steps[0]) if caps.steps else 2
    width, height = caps.default_width, caps.default_height
    if limits is not None and width * height > limits.max_pixels:  # the operator allows less: the smallest size
        width, height = min(caps.sizes, key=lambda s: s[0] * s[1]) if caps.sizes else (caps.size_multiple * 2,) * 2
    # Families that animate or edit an image get one (a gray picture, encoded as a client would send it): some need
    # it (Qwen-Image-Edit, Wan I2V), and edits are what the others are served for.
    edits = videos_api.FIRST_FRAME in caps.image_inputs or "edit" in caps.image_inputs
    image = gray_png(width, height) if edits else None
    # Video: the default size in the shortest clip past one frame (1 + frame_step frames), not the default clip,
    # whose every step costs about a minute for Wan 14B at 81 frames on one GPU; it runs every kernel all the same.
    frames = 1 + caps.frame_step if caps.modality == "video" and caps.frame_step else None
    fields = dict(width=width, height=height, guidance_scale=caps.default_guidance, image=image, num_frames=frames)
    if caps.modality == "audio":  # a sound has no size (Stable Audio's family: its seconds' defaults)
        fields = {name: value for name, value in fields.items() if name not in ("width", "height")}
    if caps.mode == "generic":  # only what the pipeline's call takes (a sound model takes no size)
        fields = {name: value for name, value in fields.items() if name in caps.fields}
    return SamplingParams(prompt="warm-up", seed=0, num_inference_steps=steps, **fields)


def warm_up_requests(
    caps: Capabilities, *, compiled: bool, limits: RequestLimits | None = None
) -> list[list[SamplingParams]]:
    """Groups of warm-up requests, each group admitted together. One default request; compiled, also one without
    CFG (one row per request: torch specialises size 1) and two CFG requests together (several rows), so that no
    later batch recompiles."""
    first = warm_up_params(caps, limits)
    if not compiled:
        return [[first]]
    low, high = caps.guidance or (0.0, 1.0)
    no_cfg = msgspec.structs.replace(first, guidance_scale=max(low, min(1.0, high)))  # CFG is off at <= 1
    return [[first], [no_cfg], [first, msgspec.structs.replace(first, seed=1)]]


def request_limits(config: ServeConfig, caps: Capabilities) -> RequestLimits:
    """The operator's limits, or defaults from the model: 4x its default image area (capped by its largest
    sides), 4x its default step count (at least 50) and, for video, the most frames it makes. SetupError (exit 2)
    for limits under which the checkpoint can make nothing."""
    default_pixels = min(4 * caps.default_width * caps.default_height, caps.max_side * caps.max_side)
    limits = RequestLimits(
        max_pixels=config.max_pixels or default_pixels,
        max_steps=config.max_steps or max(50, 4 * caps.default_steps),
        max_frames=(config.max_frames or caps.max_num_frames) if caps.modality == "video" else None,
    )
    # Limits below everything the checkpoint makes would refuse every request: refused at start instead.
    fewest = caps.steps[0] if caps.steps else 1
    if limits.max_steps < fewest:
        raise SetupError(
            f"--max-steps {limits.max_steps} is below the fewest steps this checkpoint declares ({fewest}): "
            "no request could be served"
        )
    smallest = min(w * h for w, h in caps.sizes) if caps.sizes else caps.size_multiple**2
    if caps.modality != "audio" and limits.max_pixels < smallest:
        raise SetupError(
            f"--max-pixels {limits.max_pixels} is below the smallest image this checkpoint makes ({smallest} "
            "pixels): no request could be served"
        )
    return limits


def _model_id(model: str) -> str:
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def reload_tenants(app: web.Application) -> None:
    """SIGHUP: the tenants' file read again (a file that cannot be used changes nothing), their series added."""
    if app[TENANTS].reload():
        app[METRICS].add_tenants(app[TENANTS].current.names())


# ---- middlewares ----


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except ClientGone as exc:
        # `track` or the stream's replay (daemon/replay.py) logged it; aiohttp finishes the response it started.
        log.debug("write failed, client gone: %s %s (request %s)", request.method, request.path, exc)
        return exc.response
    except ParamError as exc:
        return ApiError(400, str(exc), param=exc.param, code="invalid_value").response()
    except QueueFullError as exc:
        return retry_later(f"too many requests in flight: {exc}", "queue_full", status=429).response()
    except DatabaseAway as exc:  # the shared job database restarts or fails over: the writer connects again
        return retry_later(f"{exc}; try again", "database_unavailable", after=2).response()
    except web.HTTPException as exc:
        if exc.status == 413:
            return too_large(native_limit(request.app[STATE].config)).response()
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"), headers=headers).response()
    except asyncio.CancelledError:
        raise
    except ConnectionError:
        # A client gone before its response started: aiohttp has nothing to send it.
        log.debug("client hung up: %s %s", request.method, request.path)
        raise asyncio.CancelledError from None
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal server error; details are in the server log", type="server_error").response()


@web.middleware
async def wait_for_heal(request: web.Request, handler) -> web.StreamResponse:
    """A restarted group's rank 0 (`ServerState.healing`): API requests wait for the model to be ready again (probes
    answer at once)."""
    state = request.app[STATE]
    if state.healing and not state.ready and request.path not in PROBES:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.loaded.wait(), HEAL_WAIT_S)
    return await handler(request)


# ---- health ----


async def health(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    if engine is not None and engine.error is not None:
        # Details are in the log, not for whoever probes.
        return web.json_response({"status": "engine_failed"}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    db = request.app.get(videos_api.JOB_DB)
    if db is not None and db.away is not None:  # jobs could be neither taken nor kept: balancers send them elsewhere
        return web.json_response({"status": "database_unavailable", "reason": db.away}, status=503)
    if state.ready and not state.leaving and not state.draining and state.engine is not None and state.engine.alive:
        return web.json_response({"status": "ready", "model": state.model_id})
    status = "draining" if state.leaving or state.draining else ("failed" if state.load_error else "loading")
    return web.json_response({"status": status}, status=503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format, or OpenMetrics when the scraper asks for it. Rendered in a pool thread (it touches no
    torch): with many label values it takes milliseconds the event loop owes to streams."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = await asyncio.get_running_loop().run_in_executor(None, encoder, request.app[METRICS].registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def openapi_document(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine if state.ready else None
    if engine is None:
        body = _openapi(None, None, state.config.max_n, False, (), None)
    else:
        registry = engine.adapter.lora_registry
        names = tuple(sorted(registry.entries)) if registry is not None else ()
        rules = _RULES.get(engine)
        if rules is None:
            rules = _RULES[engine] = field_rules(engine)
        caps, limits, lora_dir = engine.adapter.capabilities, engine.limits, state.config.lora_dir is not None
        body = _openapi(caps, limits, state.config.max_n, lora_dir, rules, names)
    return web.Response(body=body, content_type="application/json")


# The fields each loaded model takes (daemon/field_rules.py: asked of its rules once, 87-123 resolutions, ~1 ms).
_RULES: weakref.WeakKeyDictionary[Engine, tuple] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=16)
def _openapi(
    caps: Capabilities | None,
    limits: RequestLimits | None,
    max_n: int,
    lora_dir: bool,
    rules: tuple,
    lora_names: tuple[str, ...] | None,
) -> bytes:
    """Built on the first request (~10 ms), not at every start: the code's routes and bounds, and the model's (again
    when the registered LoRA adapters change)."""
    return msgspec.json.encode(served_document(caps, limits, max_n, lora_dir, rules, lora_names))


PLAYGROUND = Path(__file__).parent / "static" / "index.html"


async def playground(request: web.Request) -> web.Response:
    """The playground page: plain HTML and JS, no build step."""
    return web.FileResponse(PLAYGROUND, headers={"Cache-Control": "no-cache"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_entry(state, name) for name in state.model_names]})


async def model(request: web.Request) -> web.Response:
    """OpenAI's model retrieval (`client.models.retrieve`): one of the names served, 404 for another."""
    state = request.app[STATE]
    return web.json_response(_model_entry(state, state.model_named(request.match_info["model"])))


def _model_entry(state: ServerState, name: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "diffusiond"}
    if state.engine is not None:
        # Our extension (OpenAI clients ignore unknown fields): what a UI needs to offer sensible controls.
        # Requests outside these are refused with a 400 naming the field, before any work starts.
        caps = state.engine.adapter.capabilities
        entry["diffusiond"] = {
            **caps.public(),
            "default_width": caps.default_width,
            "default_height": caps.default_height,
            "default_guidance": caps.default_guidance,
            "max_steps": state.engine.limits.max_steps if state.engine.limits else None,
            "max_pixels": state.engine.limits.max_pixels if state.engine.limits else None,
        }
    return entry
