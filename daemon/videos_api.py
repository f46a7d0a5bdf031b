"""OpenAI's Videos API on a video model: `POST /v1/videos` queues a job that runs whatever its client does;
`GET /v1/videos/{id}` reports it, `GET /v1/videos/{id}/content` serves its file, `GET /v1/videos` lists jobs and
`DELETE /v1/videos/{id}` cancels one and removes its file (daemon/jobs_api.py, for both kinds of job: a sound
model's are daemon/audio_jobs.py's).

Each job runs as a task of its own (daemon/video_jobs.py): its progress follows the steps, and once the clip is done
it is encoded and written to the store (`video_store.py`). Every admitted job ends in one of completed, failed or
cancelled.

`seconds` becomes frames at the request's fps (the model's by default): the shortest clip of the family's form
(1 + frame_step * k frames) that plays for at least that long, refused when it has more frames than the model makes;
without it, OpenAI's 4 seconds (where the model makes a clip that long; else its own default). The job's `seconds` is
what the request asked ("4"), its `num_frames` the clip's real count beside it (65 at 16 fps).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
from aiohttp import web

from diffusiond.daemon.admission import queue_requests, quota_exceeded, resolve_priority
from diffusiond.daemon.api import (
    ApiError,
    VideoCreateRequest,
    retry_later,
)
from diffusiond.daemon.auth import TENANT, tenant_of
from diffusiond.daemon.files import FILES, MEDIA, FileStore, base_url
from diffusiond.daemon.idempotency import HEADER, KEYS, REPLAYED, WINDOW_S, fingerprint
from diffusiond.daemon.job_db import JobDB, database_errors
from diffusiond.daemon.job_leases import keep_leases
from diffusiond.daemon.state import STATE, Record
from diffusiond.daemon.streaming import check_images
from diffusiond.daemon.video_jobs import JOB_DB, VIDEOS, VideoJobs, tell
from diffusiond.daemon.video_requests import read_video_create, reported_seconds, resolve_video
from diffusiond.daemon.video_store import (
    MIN_FREE_BYTES,
    QuotaFull,
    StoreFull,
    VideoJob,
    VideoStore,
    free_bytes,
    remove_dead_folders,
    temporary_folder,
)
from diffusiond.models.params import SamplingParams

log = logging.getLogger(__name__)

# How long a repeated POST waits for the job its Idempotency-Key names to be recorded (by another replica).
REPLAY_WAIT_S = 5.0
ABANDONED = "the server stopped before the request finished (a restart or a crash); send it again"
# Which `image_inputs` a family declares when its videos may start from an image (`input_reference`).
FIRST_FRAME = "first-frame"


async def videos_ctx(app: web.Application) -> AsyncIterator[None]:
    """The store (`--video-dir`, else a temporary folder removed at exit), its expiry sweep, and the jobs' tasks,
    cancelled at shutdown. Registered after the engine's context, so it ends first, while the engine still runs."""
    config = app[STATE].config
    folder = config.video_dir or (str(Path(config.state_dir) / "videos") if config.state_dir else None)
    owned = folder is None
    if owned:
        tmp = Path(tempfile.gettempdir())
        if removed := await asyncio.to_thread(remove_dead_folders, tmp):
            log.info("video store: removed %d temporary folders of daemons that were killed", removed)
        directory = await asyncio.to_thread(temporary_folder, tmp)
    else:
        directory = Path(folder)
    store = VideoStore(
        directory, max_bytes=config.video_store_bytes, ttl=config.video_ttl, max_jobs=config.video_max_jobs
    )
    if config.state_url is not None:  # a shared folder's videos are the job table's (and others' files)
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    elif not owned:
        loaded = await asyncio.to_thread(store.load)
        if loaded:
            log.info("video store: %d videos kept in %s", loaded, directory)
    jobs = app[VIDEOS] = VideoJobs(store)
    db = None
    if config.state_url is not None or config.state_dir is not None:
        target = config.state_url or Path(str(config.state_dir)) / "diffusiond.db"
        replica = config.replica_id or (f"{socket.gethostname()}:{config.port}" if config.state_url else "local")
        db = app[JOB_DB] = await asyncio.to_thread(JobDB, target, replica=replica, lease_s=config.job_lease)
        store.forgotten = db.delete
        abandoned = await db.abandon_requests(ABANDONED)
        if abandoned:
            log.info("requests: %d left unfinished by the previous run of this replica, marked failed", abandoned)
        app[STATE].journal = functools.partial(_journal, db)
        for raw in await db.finished_here():  # webhooks a previous run did not deliver, sent again (same event ids)
            if (job := msgspec.json.decode(raw, type=VideoJob)).webhook is not None:
                tell(app, db, job)
    secret = config.url_secret.encode() if config.url_secret else secrets.token_bytes(32)
    # Replicas sharing the folder: each its own images, in a folder of its own (each removes its stale ones).
    own = directory / "files" / re.sub(r"[^\w.-]", "_", db.replica) if db is not None and db.shared else None
    files = app[FILES] = FileStore(
        own or directory / "files", max_bytes=config.video_store_bytes, ttl=config.video_ttl, secret=secret
    )
    # One budget (--video-store-bytes) and one max_stored_bytes per tenant for videos and images kept by URL.
    store.others_hold = lambda owner: files.used if owner is None else files.held_by(owner)
    files.others_hold = lambda owner: store.used if owner is None else store.held_by(owner)
    sweeper = asyncio.create_task(_sweep(store, min(60.0, max(1.0, config.video_ttl / 4))))
    leasing = asyncio.create_task(keep_leases(app, db, jobs)) if db is not None else None
    try:
        yield
    finally:
        for task in filter(None, (sweeper, leasing)):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await jobs.close()
        if db is not None:
            if db.shared:  # what this replica leaves unfinished, another takes at once
                with contextlib.suppress(*database_errors()):
                    await db.release()
            await asyncio.to_thread(db.close)
        if owned:
            await asyncio.to_thread(shutil.rmtree, directory, True)


def public_job(request: web.Request, job: VideoJob) -> dict:
    """The video object, with `url` once completed: its file at a signed URL that needs no API key
    (daemon/files.py), valid until the job expires."""
    out = job.public()
    if job.file_name is not None and job.expires_at is not None:
        base = base_url(request, request.app[STATE].config.public_base_url)
        out["url"] = request.app[FILES].signed(base, job.id, job.expires_at)
    return out


def _journal(db: JobDB, rec: Record, params: SamplingParams | None) -> None:
    """A request's record to the job database (ServerState.journal): its parameters without its input images."""
    if params is not None:
        params = msgspec.structs.replace(params, image=None, mask=None, reference_images=None)
    encoded = None if params is None else msgspec.json.encode(params)
    db.journal(rec.id, rec.owner, rec.status, rec.error, msgspec.json.encode(rec), encoded)


async def stored_record(app: web.Application, request_id: str) -> Record | None:
    """A request's record from the job database: one a previous run of this replica (or another replica) made."""
    db = app.get(JOB_DB)
    row = None if db is None else await db.request(request_id)
    if row is None:
        return None
    rec = msgspec.json.decode(row[3], type=Record)
    rec.owner, rec.status, rec.error = row[0], row[1], row[2]
    return rec


async def file_content(request: web.Request) -> web.StreamResponse:
    """An image, or a completed video, by its signed URL (daemon/files.py): no API key; 404 for anything not
    signed here, expired, or gone."""
    files, file_id = request.app[FILES], request.match_info["id"]
    expires, signature = request.query.get("expires", ""), request.query.get("signature", "")
    gone = ApiError(404, "no such file, or its URL expired or was not signed here", code="not_found")
    if file_id.startswith(("video_", "audio_")):
        job = await find_job(request.app, file_id) if files.valid(file_id, expires, signature) else None
        path = request.app[VIDEOS].store.path(job) if job is not None else None
        if job is None or path is None or not path.is_file():
            raise gone
        media, until = MEDIA[job.format], job.expires_at or 0
    else:
        entry = files.lookup(file_id, expires, signature)
        if entry is not None:
            path, media, until = files.directory / entry.name, MEDIA[entry.format], entry.expires_at
        elif (found := files.elsewhere(file_id, expires, signature)) is not None:
            path, media, until = found[0], MEDIA[found[1]], int(expires)
        else:
            raise gone
    left = max(0, until - int(files.clock()))
    return web.FileResponse(path, headers={"Content-Type": media, "Cache-Control": f"private, max-age={left}"})


async def _sweep(store: VideoStore, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            for job_id in store.sweep():
                log.debug("video store: %s expired", job_id)
        except Exception:  # expiry goes on; routes sweep too, and answer what they can
            log.exception("video store: expiry failed; trying again in %gs", every)


# ---- routes ----


async def create_video(request: web.Request) -> web.StreamResponse:
    body, reference = await read_video_create(request)
    digest = fingerprint(request.path, msgspec.json.encode(body), reference or b"")
    return await request.app[KEYS].once(
        request, request[TENANT], digest, lambda: _create_video(request, body, reference, digest)
    )


async def _create_video(
    request: web.Request, body: VideoCreateRequest, reference: bytes | None, digest: str
) -> web.Response:
    state = request.app[STATE]
    engine = state.require_engine()
    caps = engine.adapter.capabilities
    check_job_model(request, "video", body.model)
    if reference is not None:
        if FIRST_FRAME not in caps.image_inputs:
            raise ApiError(
                400, "this model makes videos from text only; it takes no input_reference", param="input_reference"
            )
        await check_images(request, {"input_reference": reference})
    resolved = resolve_video(engine, body, reference)
    rid = uuid.uuid4().hex
    return await admit_once(request, digest, f"video_{rid}", lambda: _new_job(request, resolved, rid, body))


async def admit_once(
    request: web.Request, digest: str, job_id: str, admit: Callable[[], Awaitable[web.Response]]
) -> web.Response:
    """`admit()` the job `job_id`, unless the job database knows the request's Idempotency-Key: then the job the
    first request with it made. The key is kept with the jobs: a retry that reaches another replica, or comes after a
    restart, finds it."""
    db, key = request.app.get(JOB_DB), request.headers.get(HEADER)
    if db is None or key is None:
        return await admit()
    tenant = tenant_of(request)
    first = await db.remember_key(tenant.name, request.path, key, digest, job_id, WINDOW_S)
    if first[1] != job_id:
        return await _replayed(request, key, digest, *first)
    try:
        return await admit()
    except BaseException:
        db.forget_key(tenant.name, request.path, key, job_id)
        raise


async def _new_job(request: web.Request, resolved: SamplingParams, rid: str, body: VideoCreateRequest) -> web.Response:
    assert resolved.num_frames is not None and resolved.fps is not None and resolved.seed is not None
    job = VideoJob(
        id=f"video_{rid}",
        request_id=rid,
        created_at=0,
        model=request.app[STATE].model_named(body.model),
        prompt=resolved.prompt,
        size=f"{resolved.width}x{resolved.height}",
        seconds=reported_seconds(body, resolved, request.app[STATE].require_engine().adapter.capabilities),
        num_frames=resolved.num_frames,
        fps=resolved.fps,
        seed=resolved.seed,
    )
    return await admit_job(request, job, resolved, body.priority, cacheable=body.seed is not None,
                           deadline_ms=body.deadline_ms)  # fmt: skip


def check_job_model(request: web.Request, modality: str, model: str | None) -> None:
    """A job route's model: the one served here, making what the route makes (ApiError naming `model`: 400 with the
    route for what it makes, 404 for another name)."""
    state = request.app[STATE]
    made = state.require_engine().adapter.capabilities.modality
    if made != modality:
        routes = {"video": "/v1/videos", "audio": "/v1/audio/generations"}
        raise ApiError(
            400,
            f"the model served here ({state.model_id}) makes {made}: use POST "
            f"{routes.get(made, '/v1/images/generations')}",
            param="model",
            code="unsupported_model",
        )
    state.model_named(model)


async def admit_job(
    request: web.Request,
    job: VideoJob,
    resolved: SamplingParams,
    priority: int | None,
    *,
    cacheable: bool,
    deadline_ms: int | None,
) -> web.Response:
    """A new job admitted: room made for it in the store (429/507 when there is none), its record written before it
    is queued (a job the client hears of is never lost), its task started; the job object answered."""
    state, jobs, tenant = request.app[STATE], request.app[VIDEOS], tenant_of(request)
    engine = state.require_engine()
    job.priority, job.owner = resolve_priority(state, tenant, priority), tenant.name
    try:
        jobs.store.make_room_for(tenant.name, tenant.max_stored_jobs)
    except StoreFull as exc:
        raise retry_later(str(exc), "queue_full", status=429) from None
    except QuotaFull as exc:
        raise quota_exceeded(state, tenant, exc.quota, str(exc)) from None
    try:
        free = free_bytes(jobs.store.directory)  # one statfs call
    except OSError as exc:
        free, why = 0, f"the store cannot be read ({exc.strerror or exc})"
    else:
        why = f"the job store's disk has {free} bytes free"
    if free < MIN_FREE_BYTES:
        raise ApiError(507, f"{why}; no new jobs until there is room", type="server_error", code="insufficient_storage")
    job.created_at = int(jobs.store.clock())
    db = request.app.get(JOB_DB)
    if db is not None:  # written before it is admitted: a job the client hears of is never lost
        await db.put(job.id, tenant.name, job.status, msgspec.json.encode(resolved), msgspec.json.encode(job))
    try:
        (handle,) = queue_requests(
            engine, state, [resolved], tenant=tenant, checked=True, ids=[job.request_id], priority=job.priority,
            cacheable=cacheable, deadline_ms=deadline_ms,
        )  # fmt: skip
    except BaseException:
        if db is not None:
            db.delete(job.id)
        raise
    jobs.store.add(job)
    jobs.start(request.app, job, handle)
    return json_response(public_job(request, job))


async def _replayed(request: web.Request, key: str, digest: str, first_digest: str, job_id: str) -> web.Response:
    """The answer to a repeat of a POST whose Idempotency-Key the job database knows: the job the first made."""
    if first_digest != digest:
        raise ApiError(
            422,
            f"{HEADER} {key!r} was used with another body; use a new key for a new request",
            param=HEADER,
            code="idempotency_key_reused",
        )
    # The first may be between its key and its job's record (on another replica): polled, a few times.
    for _ in range(int(REPLAY_WAIT_S / 0.1)):
        if (job := await find_job(request.app, job_id)) is not None:
            break
        await asyncio.sleep(0.1)
    if job is None or job.owner != request[TENANT]:
        raise ApiError(
            409,
            f"the video job the first request with {HEADER} {key!r} made is gone (deleted, expired, or it never "
            "started); send the request with a new key",
            param=HEADER,
            code="idempotency_key_retry",
        )
    response = json_response(public_job(request, job))
    response.headers[REPLAYED] = "true"
    return response


async def find_job(app: web.Application, job_id: str) -> VideoJob | None:
    """A job, whichever replica runs it: with a shared database, its record there (this replica's own copy while
    it runs here, whose progress is fresher); else the store's."""
    videos, db = app[VIDEOS], app.get(JOB_DB)
    job = videos.store.get(job_id)
    if db is None or not db.shared or (job is not None and job_id in videos.tasks and job_id not in videos.lost):
        return job
    row = await db.get(job_id)
    if row is None:
        if job is not None:  # another replica deleted it, or its time was up
            videos.store.drop(job_id)
        return None
    return msgspec.json.decode(row[1], type=VideoJob)


def json_response(data: dict) -> web.Response:
    return web.json_response(data, dumps=lambda o: msgspec.json.encode(o).decode())
