"""A video (or sound) job's run: a task of its own (a strong reference in `VideoJobs.tasks`, cancelled at shutdown)
that reads the engine request's events, moves its progress with the steps (to STEPS_SHARE; the encoding takes the
rest), encodes the clip in the encoder pool and writes it to the store (`video_store.py`) under the lease's fence, and
tells the tenant's webhook how it ended (daemon/webhooks.py). Split from videos_api.py, which admits the jobs and
serves them."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import time

import msgspec
from aiohttp import web

from diffusiond.daemon.audio_encoding import completed_sound, encode_sound
from diffusiond.daemon.auth import TENANTS
from diffusiond.daemon.job_db import DatabaseAway, JobDB
from diffusiond.daemon.state import ENCODERS, STATE
from diffusiond.daemon.streaming import run_encoder
from diffusiond.daemon.video_encoding import encode_video
from diffusiond.daemon.video_store import (
    DiskFull,
    QuotaFull,
    VideoJob,
    VideoStore,
    VideoTooLarge,
    discard_staged,
    publish_video,
    stage_video,
)
from diffusiond.daemon.webhooks import endpoint, new_event_id, notify
from diffusiond.engine.engine import RequestHandle
from diffusiond.engine.outputs import Cancelled, Completed, Failed, Progress

log = logging.getLogger(__name__)

# Progress the denoising steps take; encoding and writing the file take the rest.
STEPS_SHARE = 95
# At shutdown, jobs whose clip is done get this long to write their file before they are cancelled.
STORE_GRACE_S = 10.0


class VideoJobs:
    """The store and the tasks of the jobs still running."""

    def __init__(self, store: VideoStore) -> None:
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}
        # Jobs whose clip is done and is being encoded and written.
        self.storing: set[str] = set()
        # Jobs this replica ran whose lease went to another (daemon/job_db.py): cancelled here, not ended.
        self.lost: set[str] = set()
        # Jobs whose last change of status could not be written (the shared database was away): written again by
        # the lease keeper once it is back, before it claims anything (job_leases.py), or a job that completed
        # during the outage would look unfinished, and run again once its lease ran out.
        self.unwritten: dict[str, VideoJob] = {}

    def written(self, job: VideoJob, future: asyncio.Future) -> None:
        """A status write of `job` ended: kept for writing again if the database was away, else done with."""
        if future.cancelled():
            return
        if isinstance(future.exception(), DatabaseAway):
            self.unwritten[job.id] = job
        else:
            self.unwritten.pop(job.id, None)

    def start(self, app: web.Application, job: VideoJob, handle: RequestHandle) -> None:
        task = asyncio.create_task(self._run(app, job, handle), name=f"diffusiond-{job.id}")
        self.tasks[job.id] = task
        task.add_done_callback(lambda _: self.tasks.pop(job.id, None))

    async def close(self) -> None:
        """Shutdown: jobs whose clip is done get a moment to write it; the others are cancelled (which cancels
        their engine requests)."""
        storing = [self.tasks[i] for i in self.storing if i in self.tasks]
        if storing:
            await asyncio.wait(storing, timeout=STORE_GRACE_S)
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, app: web.Application, job: VideoJob, handle: RequestHandle) -> None:
        store, db = self.store, app.get(JOB_DB)
        written, told = job.status, False

        def write() -> None:  # each change of status, in order (one writer thread)
            nonlocal written, told
            if job.status == "cancelled" and app[STATE].draining:
                return  # cancelled by the drain's deadline, not by its client: the next start runs it again
            ended = job.status in ("completed", "failed") and not told
            if ended and endpoint(app, job.owner)[0] is not None:
                job.webhook = new_event_id()  # written with its end: a restart sends it if it was not delivered
            if db is not None and job.status != written:
                written = job.status
                future = db.update(job.id, job.status, msgspec.json.encode(job), job.expires_at)
                future.add_done_callback(functools.partial(self.written, job))
            if ended:
                told = True  # once: its webhook (a job another replica took over never gets here)
                tell(app, db, job)

        try:
            async for event in app[STATE].track(handle):
                if isinstance(event, Progress):
                    job.status = "in_progress"
                    job.progress = max(job.progress, STEPS_SHARE * event.step // max(1, event.total))
                elif isinstance(event, Completed):
                    job.status, job.progress = "in_progress", max(job.progress, STEPS_SHARE)
                    self.storing.add(job.id)
                    await self._store(app, job, event)
                elif isinstance(event, Cancelled):
                    store.end(job, "cancelled", "cancelled", f"cancelled: {event.reason}")
                elif isinstance(event, Failed):
                    store.end(job, "failed", "generation_failed", event.error)
                write()
        except asyncio.CancelledError:
            # Its row stays unfinished: the next start runs it again (daemon/job_db.py).
            store.end(job, "cancelled", "cancelled", "the server shut down before the video was done")
            raise
        except Exception:
            log.exception("video job %s failed", job.id)
            message = "internal error while storing the video; details are in the server log"
            store.end(job, "failed", "internal_error", message)
            write()
        finally:
            self.storing.discard(job.id)
            if job.id in self.lost:  # its record and files are the other replica's
                self.lost.discard(job.id)
                store.drop(job.id)

    def lose(self, app: web.Application, job_id: str) -> None:
        """A job this replica runs is no longer its own (its lease ran out while it stalled, or another replica
        deleted it): cancelled at its next step, its end written nowhere (`update` is fenced by the lease)."""
        job = self.store.jobs.get(job_id)
        if job is None or job.finished or job_id not in self.tasks:  # ended here after the renewal's snapshot
            return
        log.warning("video job %s: its lease is another replica's now (or it was deleted); stopping it here", job_id)
        self.lost.add(job_id)
        if (engine := app[STATE].engine) is not None:
            engine.cancel(job.request_id)

    async def _store(self, app: web.Application, job: VideoJob, event: Completed) -> None:
        store = self.store
        file: dict = {}
        try:
            if job.audio_format is not None:  # a sound job (daemon/audio_jobs.py)
                clip = await run_encoder(app, encode_sound, completed_sound(event), job.audio_format)
                file = {"seconds": f"{clip.samples / clip.sample_rate:g}", "sample_rate": clip.sample_rate}
            else:
                clip = await run_encoder(app, encode_video, event.image, job.fps, "mp4", store.directory, event.audio)
        except OSError as exc:  # its staging file (in the store's folder) found no room
            log.error("video job %s: cannot encode into %s: %s", job.id, store.directory, exc)
            code = "storage_full" if exc.errno == errno.ENOSPC else "storage_error"
            store.end(job, "failed", code, f"the server could not store the video ({exc.strerror or exc}); retry later")
            return
        if store.jobs.get(job.id) is not job:  # deleted meanwhile
            return
        try:
            store.reserve(job, len(clip.data), app[TENANTS].tenant(job.owner).max_stored_bytes)
        except VideoTooLarge as exc:
            store.end(job, "failed", "video_too_large", str(exc))
            return
        except QuotaFull as exc:
            store.end(job, "failed", exc.quota, f"tenant {job.owner}: quota {exc.quota} reached ({exc})")
            return
        done = store.completion(job, clip.format, getattr(clip, "fallback", None), **file)
        db = app.get(JOB_DB)
        if db is not None and db.shared:
            done.finished_by = db.replica
        loop = asyncio.get_running_loop()
        try:
            staged = await loop.run_in_executor(app[ENCODERS], stage_video, store.directory, done, clip.data)
            if db is not None and not await _still_ours(db, job):
                # Past its lease (the replica stalled) another replica took the job and runs it again: that run
                # publishes its video, this one's is discarded (the same names, written once).
                log.warning("video job %s: another replica's now (or deleted); this run's video is discarded", job.id)
                self.lost.add(job.id)
                await loop.run_in_executor(app[ENCODERS], discard_staged, staged)
                return
            await loop.run_in_executor(app[ENCODERS], publish_video, store.directory, staged)
        except DiskFull as exc:
            log.error("video job %s: %s", job.id, exc)
            store.end(job, "failed", "storage_full", f"the server's video store is full: {exc}; retry later")
            store.discard_files(done)
            return
        except OSError as exc:
            log.error("video job %s: cannot write its file to %s: %s", job.id, store.directory, exc)
            store.end(job, "failed", "storage_error", "the server could not store the video")
            store.discard_files(done)
            return
        if store.jobs.get(job.id) is not job:  # deleted while it was written
            store.discard_files(done)
            return
        store.complete(job, done)


def tell(app: web.Application, db: JobDB | None, job: VideoJob) -> None:
    """A finished job's webhook (`job.webhook`, its event's id), sent; once delivered, the record says so (a job
    database's: else a restart would send it again)."""
    if job.webhook is None:
        return

    def delivered() -> None:
        job.webhook = None
        if db is not None:
            db.update(job.id, job.status, msgspec.json.encode(job), job.expires_at).add_done_callback(_quiet)

    created = job.completed_at or int(job.finished_at or time.time())
    kind = "video" if job.audio_format is None else "audio"
    notify(app, job.owner, f"{kind}.{job.status}", job.id, (job.webhook, created), delivered)


def _quiet(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a delivered webhook could not be marked in the job database: %s", future.exception())


async def _still_ours(db: JobDB, job: VideoJob) -> bool:
    """Whether this replica holds `job`'s lease, checked just before its video is published (the fence on files:
    the database's writes are fenced by `update`). With the database away nobody can take the job over: ours."""
    try:
        return await db.holds(job.id)
    except DatabaseAway:
        return True


VIDEOS = web.AppKey("videos", VideoJobs)
JOB_DB = web.AppKey("job_db", JobDB)
