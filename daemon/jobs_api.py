"""Reading and ending jobs, of either kind: a video model's (`/v1/videos`, daemon/videos_api.py) and a sound model's
(`/v1/audio/generations`, daemon/audio_jobs.py), which share the store, the database and the leases. Under each
prefix: `GET` lists the tenant's jobs of that kind, `GET /{id}` reports one, `GET /{id}/content` serves its file and
`DELETE /{id}` cancels it and removes its file. A job of the other kind, or another tenant's, is as unknown as one
never made."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.auth import TENANT
from diffusiond.daemon.files import MEDIA
from diffusiond.daemon.state import STATE
from diffusiond.daemon.video_store import VideoJob
from diffusiond.daemon.videos_api import JOB_DB, VIDEOS, find_job, json_response, public_job

LIST_LIMIT = (20, 100)  # default, most
# How long DELETE waits for a running job to stop (at its next step boundary) before it answers.
DELETE_WAIT_S = 30.0
KINDS = ("video", "audio")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_job_routes(router: web.UrlDispatcher, prefix: str, kind: str) -> None:
    """The four routes of `kind`'s jobs under `prefix` (the create route is the kind's own)."""
    assert kind in KINDS

    def bind(fn: Callable[[web.Request, str], Awaitable[web.StreamResponse]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await fn(request, kind)

        handler.__name__ = f"{fn.__name__}_{kind}"
        return handler

    router.add_get(prefix, bind(list_jobs))
    router.add_get(prefix + "/{id}", bind(retrieve_job))
    router.add_delete(prefix + "/{id}", bind(delete_job))
    router.add_get(prefix + "/{id}/content", bind(job_content))


async def get_job(request: web.Request, kind: str) -> VideoJob:
    job_id = request.match_info["id"]
    job = await find_job(request.app, job_id) if job_id.startswith(f"{kind}_") else None
    if job is None or job.owner != request[TENANT]:  # another tenant's job is as unknown as one never made
        raise ApiError(
            404,
            f"no {kind} job {job_id!r} (unknown, deleted, expired or evicted)",
            param=f"{kind}_id",
            code="not_found",
        )
    return job


async def retrieve_job(request: web.Request, kind: str) -> web.Response:
    return json_response(public_job(request, await get_job(request, kind)))


async def job_content(request: web.Request, kind: str) -> web.StreamResponse:
    job = await get_job(request, kind)
    variant = request.query.get("variant", kind)
    if variant != kind:
        raise ApiError(400, f"variant {variant!r} is not made here; only {kind!r} is", param="variant")
    path = request.app[VIDEOS].store.path(job)
    if path is None or not path.is_file():
        raise ApiError(
            409,
            f"{kind} {job.id} is {job.status}; its file exists once it is completed",
            param=f"{kind}_id",
            code=f"{kind}_not_ready" if not job.finished else f"{kind}_not_available",
        )
    assert job.format is not None
    return web.FileResponse(path, headers={"Content-Type": MEDIA[job.format]})


async def list_jobs(request: web.Request, kind: str) -> web.Response:
    query = request.query
    try:
        limit = int(query.get("limit", LIST_LIMIT[0]))
    except ValueError:
        limit = 0
    if not 1 <= limit <= LIST_LIMIT[1]:
        raise ApiError(400, f"limit must be an integer from 1 to {LIST_LIMIT[1]}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc; got {order!r}", param="order")
    jobs = [j for j in await _listing(request.app, request[TENANT]) if j.id.startswith(f"{kind}_")]  # in order made
    if order == "desc":
        jobs.reverse()
    start = 0
    if "after" in query:
        ids = [j.id for j in jobs]
        if query["after"] not in ids:
            raise ApiError(400, f"after: no {kind} job {query['after']!r}", param="after")
        start = ids.index(query["after"]) + 1
    page = jobs[start : start + limit]
    return json_response(
        {
            "object": "list",
            "data": [public_job(request, j) for j in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": start + limit < len(jobs),
        }
    )


async def delete_job(request: web.Request, kind: str) -> web.Response:
    """Forgets the job at once and removes its file; a job still running is cancelled, and the answer waits (up to
    DELETE_WAIT_S) for it to stop at its next step boundary."""
    job = await get_job(request, kind)
    videos = request.app[VIDEOS]
    if videos.store.remove(job.id) is None and (db := request.app.get(JOB_DB)) is not None:
        # Another replica's (a shared database): its record and files go here; if it runs the job, it finds its
        # lease gone at its next renewal and stops it.
        await db.delete(job.id)
        videos.store.discard_files(job)
    task = videos.tasks.get(job.id)
    engine = request.app[STATE].engine
    if task is not None:
        if engine is not None:
            engine.cancel(job.request_id)
        await asyncio.wait([task], timeout=DELETE_WAIT_S)  # never cancels the task itself
    return json_response({"id": job.id, "object": f"{kind}.deleted", "deleted": True})


async def _listing(app: web.Application, tenant: str) -> list[VideoJob]:
    videos, db = app[VIDEOS], app.get(JOB_DB)
    if db is None or not db.shared:
        return [j for j in videos.store.listing() if j.owner == tenant]
    here = {i: videos.store.jobs[i] for i in videos.tasks if i in videos.store.jobs and i not in videos.lost}
    records = [msgspec.json.decode(raw, type=VideoJob) for raw in await db.listing(tenant)]
    return [here.get(j.id, j) for j in records]
