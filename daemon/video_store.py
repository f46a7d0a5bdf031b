"""Video jobs and their files: a store bounded in bytes on disk, in age and in jobs remembered.

A job is remembered from its creation. Once it finishes (completed, failed or cancelled) it expires `ttl` seconds
later (its `expires_at`), with its file. Finished videos take at most `max_bytes` on disk: a new one makes room by
evicting the videos that finished first; one larger than the whole budget fails. At most `max_jobs` jobs are
remembered: a new one makes room by forgetting the job that finished first. A job still queued or running is never
evicted, expired or forgotten (it has no file yet; the engine's queue bounds how many there are).

Bookkeeping runs on the event loop and never awaits; files are written in the encoder pool (`write_video`), and
removed here (an unlink each). In a folder the operator gives, every completed video has a JSON file beside it, so
that a restarted daemon serves it again (`load`).

A full or failing disk fails the job it hits, never the daemon: a write checks the free space first (and leaves no
temporary file on any error), the budget counts each video's JSON file too, a file is on disk (fsync of the file
and its folder) before its job says completed, expiry logs what it cannot remove and goes on, and a JSON file is
checked field by field before it names a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from diffusiond.kernels.process_folders import new_folder, remove_dead

log = logging.getLogger(__name__)

FINISHED = ("completed", "failed", "cancelled")
# The files of a job: its video (or sound: daemon/audio_jobs.py), the JSON beside it, and a file being written.
_OURS = re.compile(r"(video|audio)_[0-9a-f]{32}(\.[0-9a-f]{8})?\.(mp4|webp|wav|flac|json|tmp)|diffusiond-\w+\.mp4")
JobId = Annotated[str, msgspec.Meta(pattern=r"^(video|audio)_[0-9a-f]{32}$")]
# What a video's JSON file takes on disk, counted in the budget beside the video.
SIDECAR_BYTES = 4096


def temporary_folder(parent: Path) -> Path:
    """A new folder under `parent` for a daemon given none, removed at its exit; named after this host and process,
    so that the folders of daemons killed on this host (SIGKILL, the OOM killer: no exit to remove them) go at the
    next start (`remove_dead_folders`). A test session once left 247 of them in /tmp."""
    return new_folder(parent, _prefix())


def remove_dead_folders(parent: Path) -> int:
    """Remove the temporary folders under `parent` of this host's daemons that are no longer running; how many.
    Another host's (a shared /tmp) or a live process's are left, and so is what cannot be removed (another user's)."""
    return remove_dead(parent, _prefix())


def _prefix() -> str:
    """`diffusiond-videos-<host>-`: the host's name without dashes, so that it cannot run into the process id."""
    import socket

    host = re.sub(r"[^\w.]", "_", socket.gethostname())
    return f"diffusiond-videos-{host}-"


# Free space a write leaves on the store's disk, and that a new job needs to be taken.
MIN_FREE_BYTES = 8 << 20


class VideoJob(msgspec.Struct, kw_only=True):
    """One `/v1/videos` job: OpenAI's video object, plus what the clip is (frames, fps, seed) and its file. A sound
    model's job (`/v1/audio/generations`, daemon/audio_jobs.py) is one too, with `audio_format` set: no frames, and
    its `seconds` and `sample_rate` are the file's once it is done."""

    id: JobId
    # The engine's request id (`/v1/generations/{request_id}` reports its steps).
    request_id: str
    created_at: int
    model: str
    prompt: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    seed: int
    # queued, in_progress, then one of FINISHED.
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None
    # The file: "mp4", or "webp" (asked for, or `fallback` says why), "wav" or "flac" (sound), and its size.
    format: Literal["mp4", "webp", "wav", "flac"] | None = None
    fallback: str | None = None
    bytes: int = 0
    # When it finished, on the store's clock: expiry and eviction order.
    finished_at: float | None = None
    # The tenant that made it (daemon/tenants.py): only it lists, reads, downloads or deletes it.
    owner: str = "default"
    # Its class (engine/scheduler.py), kept for a rerun after a restart.
    priority: int = 0
    # A sound job: the file it makes ("wav" or "flac"), and the rate of its samples once done.
    audio_format: Literal["wav", "flac"] | None = None
    sample_rate: int | None = None
    # The replica whose run made its file (--replica-id; replicas sharing a job database): one run is published.
    finished_by: str | None = None
    # The id of its webhook event while it is not yet delivered (daemon/webhooks.py): sent again after a restart.
    webhook: str | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def file_name(self) -> str | None:
        return f"{self.id}.{self.format}" if self.format is not None and self.status == "completed" else None

    def public(self) -> dict:
        """OpenAI's video object, with our fields after its own; a sound job's object is "audio", without frames."""
        if self.audio_format is not None:
            return self._public_audio()
        out = {
            "id": self.id,
            "object": "video",
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "model": self.model,
            "prompt": self.prompt,
            "seconds": self.seconds,
            "size": self.size,
            "error": self.error,
            "remixed_from_video_id": None,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "seed": self.seed,
        }
        if self.format is not None:
            out["format"] = self.format
        if self.fallback is not None:
            out["format_fallback"] = self.fallback
        if self.finished_by is not None:
            out["finished_by"] = self.finished_by
        return out

    def _public_audio(self) -> dict:
        out = {"id": self.id, "object": "audio", "status": self.status, "progress": self.progress}
        for name in ("created_at", "completed_at", "expires_at", "model", "prompt", "seconds", "error", "seed"):
            out[name] = getattr(self, name)
        out["format"] = self.format or self.audio_format
        if self.sample_rate is not None:
            out["sample_rate"] = self.sample_rate
        return out


class StoreFull(Exception):
    """`max_jobs` jobs are remembered and none of them has finished."""


class QuotaFull(Exception):
    """A tenant's share of the store is full (`quota`: max_stored_jobs or max_stored_bytes)."""

    def __init__(self, quota: str, message: str) -> None:
        super().__init__(message)
        self.quota = quota


class VideoTooLarge(Exception):
    """A video that cannot fit in the byte budget."""


class DiskFull(OSError):
    """The store's disk has no room for a file (checked before writing it)."""


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


class VideoStore:
    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        ttl: float,
        max_jobs: int,
        clock: Callable[[], float] = time.time,
        sidecar_bytes: int = SIDECAR_BYTES,
    ) -> None:
        self.directory = directory
        self.sidecar_bytes = sidecar_bytes
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.max_jobs = max_jobs
        self.clock = clock
        # In creation order.
        self.jobs: dict[str, VideoJob] = {}
        # Bytes of the videos on disk and of those being written.
        self.used = 0
        # Called with the id of each job the store forgets (removed, expired, evicted): the job database's delete.
        self.forgotten: Callable[[str], object] | None = None
        # Bytes the images kept by URL hold (all of them, or one tenant's; daemon/files.py): they share the budget
        # and a tenant's max_stored_bytes with the videos (videos_ctx wires it).
        self.others_hold: Callable[[str | None], int] = lambda owner: 0

    def held_by(self, owner: str) -> int:
        return sum(self.cost(j) for j in self.jobs.values() if j.owner == owner)

    def cost(self, job: VideoJob) -> int:
        """What a job's files take of the budget: its video and the JSON beside it."""
        return job.bytes + self.sidecar_bytes if job.bytes else 0

    def path(self, job: VideoJob) -> Path | None:
        name = job.file_name
        return None if name is None else self.directory / name

    # ---- jobs ----

    def get(self, job_id: str) -> VideoJob | None:
        self.sweep()
        return self.jobs.get(job_id)

    def listing(self) -> list[VideoJob]:
        self.sweep()
        return list(self.jobs.values())

    def make_room(self) -> None:
        """Room for one more job: forgets the jobs that finished first, those without a video before any video
        (creating and cancelling jobs in a loop must not push out others' videos), StoreFull when none has."""
        self.sweep()
        while len(self.jobs) >= self.max_jobs:
            oldest = self._first_forgettable()
            if oldest is None:
                raise StoreFull(f"{len(self.jobs)} video jobs are queued or running (--video-max-jobs)")
            self.remove(oldest.id)

    def make_room_for(self, owner: str, max_jobs: int | None) -> None:
        """Room for one more job of `owner`, within its quota of jobs too (its own finished jobs forgotten first);
        QuotaFull when all its jobs are queued or running."""
        self.make_room()
        while max_jobs is not None and sum(j.owner == owner for j in self.jobs.values()) >= max_jobs:
            oldest = self._first_forgettable(owner)
            if oldest is None:
                raise QuotaFull("max_stored_jobs", f"{max_jobs} of its video jobs are queued or running")
            self.remove(oldest.id)

    def add(self, job: VideoJob) -> None:
        self.make_room()
        self.jobs[job.id] = job

    def remove(self, job_id: str) -> VideoJob | None:
        """Forgets a job and removes its files."""
        job = self.drop(job_id)
        if job is not None:
            self.discard_files(job)
            if self.forgotten is not None:
                self.forgotten(job_id)
        return job

    def drop(self, job_id: str) -> VideoJob | None:
        """Forgets a job here only: its files and its record stay (another replica runs it now, or removed it)."""
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self.used -= self.cost(job)
        return job

    def discard_files(self, job: VideoJob) -> None:
        """Its video, JSON and temporary files; one that cannot be removed (a read-only disk) is logged, not
        raised: the job is forgotten all the same."""
        for name in (job.file_name, f"{job.id}.json", f"{job.id}.tmp"):
            if name is None:
                continue
            try:
                os.unlink(self.directory / name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("video store: cannot remove %s: %s", name, exc)

    def sweep(self) -> list[str]:
        """Forgets expired jobs, with their files; returns their ids."""
        now = self.clock()
        expired = [j.id for j in self.jobs.values() if j.finished_at is not None and j.finished_at + self.ttl <= now]
        for job_id in expired:
            self.remove(job_id)
        return expired

    def _first_forgettable(self, owner: str | None = None) -> VideoJob | None:
        """The job to forget for room (of `owner`'s, if given): the first finished without a video, else the first
        finished at all."""
        return self._first_finished(with_file=False, without_file=True, owner=owner) or self._first_finished(
            with_file=False, owner=owner
        )

    def _first_finished(
        self, *, with_file: bool, without_file: bool = False, owner: str | None = None
    ) -> VideoJob | None:
        done = [
            j
            for j in self.jobs.values()
            if j.finished
            and (j.file_name is not None or not with_file)
            and (j.file_name is None or not without_file)
            and (owner is None or j.owner == owner)
        ]
        return min(done, key=lambda j: j.finished_at or 0.0, default=None)

    # ---- a job's end ----

    def reserve(self, job: VideoJob, size: int, owner_bytes: int | None = None) -> None:
        """Room for a job's video of `size` bytes, made by evicting the videos that finished first. VideoTooLarge
        when it cannot fit; nothing is evicted then. `owner_bytes`: the job's tenant's quota of bytes, made room in
        by evicting its own videos first (QuotaFull when its video alone is larger)."""
        needed = size + self.sidecar_bytes
        if owner_bytes is not None:
            owner_bytes -= self.others_hold(job.owner)  # its images kept by URL (daemon/files.py) share the quota
            if needed > owner_bytes:
                raise QuotaFull("max_stored_bytes", f"the video is {size} bytes; the tenant may keep {owner_bytes} "
                                "more (its images kept by URL count)")  # fmt: skip
            mine = [j for j in self.jobs.values() if j.owner == job.owner and j is not job]
            if sum(self.cost(j) for j in mine if not (j.finished and j.file_name is not None)) + needed > owner_bytes:
                raise QuotaFull("max_stored_bytes", f"no room for {size} more bytes while its other videos are written")
            while sum(self.cost(j) for j in mine if j.id in self.jobs) + needed > owner_bytes:
                oldest = self._first_finished(with_file=True, owner=job.owner)
                assert oldest is not None
                log.info("video store: evicting %s (%d bytes) for its tenant's quota", oldest.id, oldest.bytes)
                self.remove(oldest.id)
        budget = self.max_bytes - self.others_hold(None)  # images kept by URL share --video-store-bytes
        if needed > budget:
            raise VideoTooLarge(
                f"the video is {size} bytes; this server keeps at most {self.max_bytes} (--video-store-bytes), "
                f"{self.max_bytes - budget} of them taken by images kept by URL"
            )
        evictable = sum(self.cost(j) for j in self.jobs.values() if j.finished and j.file_name is not None)
        if self.used - evictable + needed > budget:  # the rest is being written
            raise VideoTooLarge(f"no room for {size} more bytes while other videos are being written; retry")
        while self.used + needed > budget:
            oldest = self._first_finished(with_file=True)
            assert oldest is not None
            log.info("video store: evicting %s (%d bytes) to make room", oldest.id, oldest.bytes)
            self.remove(oldest.id)
        job.bytes = size
        self.used += needed

    def completion(self, job: VideoJob, fmt: str, fallback: str | None, **file: object) -> VideoJob:
        """The job as it will be once its file is written (what `write_video` writes beside the file); `file`: what
        the file says of itself (a sound's `seconds` and `sample_rate`)."""
        now = self.clock()
        return msgspec.structs.replace(
            job,
            **file,
            status="completed",
            progress=100,
            format=fmt,
            fallback=fallback,
            finished_at=now,
            completed_at=int(now),
            expires_at=int(now + self.ttl),
        )

    def complete(self, job: VideoJob, done: VideoJob) -> None:
        """The job's file is written: it takes `done`'s state (from `completion`)."""
        for field in (
            "status", "progress", "format", "fallback", "finished_at", "completed_at", "expires_at", "seconds",
            "sample_rate", "finished_by",
        ):  # fmt: skip
            setattr(job, field, getattr(done, field))

    def end(self, job: VideoJob, status: str, code: str, message: str) -> None:
        """A job that ends without a video (failed or cancelled); what it reserved is released."""
        assert status in FINISHED and status != "completed"
        if job.finished:
            return
        if job.id in self.jobs:
            self.used -= self.cost(job)
        job.bytes = 0
        now = self.clock()
        job.status, job.error = status, {"code": code, "message": message}
        job.finished_at, job.completed_at, job.expires_at = now, int(now), int(now + self.ttl)

    # ---- on disk ----

    def load(self) -> int:
        """Completed videos a previous run left in the folder, as jobs again (the expired and broken ones removed,
        and the budgets applied). Blocking file I/O: at start-up, off the event loop. Returns how many."""
        self.directory.mkdir(parents=True, exist_ok=True)
        names = {p.name for p in self.directory.iterdir() if _OURS.fullmatch(p.name)}
        kept: list[VideoJob] = []
        for name in sorted(n for n in names if n.endswith(".json")):
            try:
                job = msgspec.json.decode((self.directory / name).read_bytes(), type=VideoJob)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            path = self.path(job)
            if f"{job.id}.json" == name and path is not None and path.is_file() and path.stat().st_size == job.bytes:
                kept.append(job)
        keep = {n for job in kept for n in (job.file_name, f"{job.id}.json")}
        for name in names - keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
        for job in sorted(kept, key=lambda j: j.created_at):
            self.jobs[job.id] = job
            self.used += self.cost(job)
        self.sweep()
        while len(self.jobs) > self.max_jobs or self.used > self.max_bytes:
            first = self._first_finished(with_file=False)
            assert first is not None  # all loaded jobs are finished
            self.remove(first.id)
        return len(self.jobs)


Staged = list[tuple[Path, str]]


def write_video(directory: Path, job: VideoJob, data: bytes) -> None:
    """A completed job's file and the JSON beside it (`job` from `VideoStore.completion`): `stage_video`, then
    `publish_video`. Blocking file I/O: in the encoder pool."""
    publish_video(directory, stage_video(directory, job, data))


def stage_video(directory: Path, job: VideoJob, data: bytes) -> Staged:
    """A completed job's file and its JSON, each written under a temporary name of this writer's own and synced:
    [(temporary path, final name)] for `publish_video` (or `discard_staged`). Own names, since two replicas may
    finish one job (a stale one past its lease, and the lease's holder): neither writes into the other's file, and
    only the holder publishes (daemon/video_jobs.py). DiskFull before anything is written when the disk has no room;
    on any error nothing is left."""
    name = job.file_name
    assert name is not None
    sidecar = msgspec.json.encode(job)
    free = free_bytes(directory)
    if free < len(data) + len(sidecar) + MIN_FREE_BYTES:
        raise DiskFull(f"{free} bytes free on the video store's disk; the video needs {len(data) + len(sidecar)}")
    staged: Staged = []
    try:
        for target, content in ((name, data), (f"{job.id}.json", sidecar)):
            tmp = directory / f"{job.id}.{secrets.token_hex(4)}.tmp"
            staged.append((tmp, target))
            with open(tmp, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        discard_staged(staged)
        raise
    return staged


def publish_video(directory: Path, staged: Staged) -> None:
    """The staged files renamed to their names (the video first, its JSON last: a restart loads only a video whose
    JSON is there), and the folder synced, so that no reader sees half a file and a completed job's file survives
    a power cut."""
    try:
        for tmp, target in staged:
            os.replace(tmp, directory / target)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        discard_staged(staged)


def discard_staged(staged: Staged) -> None:
    for tmp, _ in staged:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def folder_problem(path: str) -> str | None:
    """Why `path` cannot keep videos (`--video-dir`), or None: it is created if missing, and must be writable."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"cannot create it: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable"
    return None
