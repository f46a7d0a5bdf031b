"""Keeping the job database's leases (daemon/job_db.py) while the daemon runs: every third of a lease, renew those
of the jobs running here, stop those that went to another replica, claim the orphans, and expire what is due.

Split from videos_api.py, which starts this loop in its context; the jobs it keeps are video_jobs.py's (`VideoJobs`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from diffusiond.daemon.admission import queue_requests
from diffusiond.daemon.api import ApiError
from diffusiond.daemon.auth import TENANTS
from diffusiond.daemon.idempotency import WINDOW_S
from diffusiond.daemon.job_db import JobDB, database_errors
from diffusiond.daemon.state import STATE
from diffusiond.daemon.video_store import VideoJob
from diffusiond.engine.engine import QueueFullError
from diffusiond.models.params import SamplingParams

if TYPE_CHECKING:
    from diffusiond.daemon.video_jobs import VideoJobs

log = logging.getLogger(__name__)

# How long finished requests' records are kept in the job database.
REQUEST_RECORDS_S = 24 * 3600.0


async def keep_leases(app: web.Application, db: JobDB, jobs: VideoJobs) -> None:
    """Once the model is ready, every third of a lease: renews the leases of the jobs running here (with their
    progress, which other replicas report), stops those that went to another replica, and claims the unfinished
    jobs whose lease ran out (first: also those this replica held before it restarted), admitted again from the
    start under their ids, oldest first, as far as the engine has room; their seeds are explicit, so each makes
    the video it would have made. With a shared database, also forgets the finished jobs whose time is up and
    removes their files, whichever replica made them."""
    state = app[STATE]
    await state.loaded.wait()
    if not state.ready or state.engine is None:
        return  # the model failed to load: nothing can run them (they stay in the database)
    every, first, keys_swept = db.lease_s / 3, True, 0.0
    while True:
        try:
            held = {i: msgspec.json.encode(jobs.store.jobs[i]) for i in list(jobs.tasks) if i in jobs.store.jobs}
            held = {i: raw for i, raw in held.items() if i not in jobs.lost}
            for job_id in held.keys() - await db.renew(held):
                jobs.lose(app, job_id)
            for job_id, job in list(jobs.unwritten.items()):  # before any claim: see VideoJobs.unwritten
                await db.update(job.id, job.status, msgspec.json.encode(job), job.expires_at)
                if jobs.unwritten.get(job_id) is job:
                    del jobs.unwritten[job_id]
            await _claim(app, db, jobs, first)
            first = False
            if time.monotonic() - keys_swept > 60:
                await db.expire_keys(WINDOW_S)
                await db.expire_requests(REQUEST_RECORDS_S)
                keys_swept = time.monotonic()
            if db.shared:
                for raw in await db.expire():
                    job = msgspec.json.decode(raw, type=VideoJob)
                    jobs.store.drop(job.id)
                    jobs.store.discard_files(job)
        except database_errors() as exc:  # the database is away: jobs run on; leases are renewed when it is back
            log.warning("job database: %s; trying again in %gs", exc, every)
        except Exception:  # never the end of the renewals: other replicas would take every job running here
            log.exception("video jobs: keeping the leases failed; trying again in %gs", every)
        await asyncio.sleep(every)


async def _claim(app: web.Application, db: JobDB, jobs: VideoJobs, first: bool) -> None:
    state = app[STATE]
    engine = state.engine
    assert engine is not None
    if state.draining:
        return
    # At the start: as many as the engine queues (this replica's own come back to it); later, only what would run
    # at once, so that a busy replica leaves the others' jobs to idle replicas.
    room = engine.capacity_left if first else min(engine.capacity_left, state.config.max_batch - engine.num_in_flight)
    rows = await db.claim(room, mine=first)
    if not rows:
        return
    log.info(
        "video jobs: %d %s, admitted again", len(rows), "left unfinished by the previous run" if first else "claimed"
    )
    for job_id, tenant, raw_params, raw_job in rows:
        if job_id in jobs.tasks:  # its lease ran out while the database was away, and it is running here still
            continue
        params = msgspec.json.decode(raw_params, type=SamplingParams)
        job = msgspec.json.decode(raw_job, type=VideoJob)
        job.status, job.progress = "queued", 0
        try:
            owner = app[TENANTS].tenant(tenant)
            priority = min(max(job.priority, owner.priority[0]), owner.priority[1])  # its range may have changed
            (handle,) = queue_requests(
                engine, state, [params], tenant=owner, checked=True, ids=[job.request_id], priority=priority
            )
        except (QueueFullError, ApiError) as exc:  # a full queue, a tenant's quota: the next claim (any replica's)
            log.info("video job %s: not admitted yet (%s)", job_id, exc)
            await db.release(job_id)
            continue
        jobs.store.add(job)
        db.update(job_id, job.status, msgspec.json.encode(job))
        jobs.start(app, job, handle)
