"""Video jobs that survive the daemon (issue 33, part 2): their records in SQLite (`--state-dir DIR`:
`DIR/diffusiond.db`, WAL), written by one thread of their own, never on the event loop.

A job is written before its creation is answered (a client that got an id can count on it), with the parameters it
runs with (the seed resolved, so that a rerun makes the same video), then again at each change of status. After a
restart or a crash, the jobs the database holds unfinished are admitted again from the start, under the same ids
(`videos_api.readmit`); completed ones are served from their files (video_store.py keeps a JSON beside each). The
schema is versioned (`schema_version`, forward-only migrations); a database from a newer diffusiond is refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# Each migration once, in order; never edited once released (add the next instead).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        status TEXT NOT NULL,
        params BLOB NOT NULL,
        job BLOB NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX jobs_unfinished ON jobs (status, created_at);
    """,
)
UNFINISHED = ("queued", "in_progress")


class JobDBError(RuntimeError):
    """A database that cannot be used (written by a newer diffusiond, or not a database)."""


class JobDB:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[tuple[Callable[[sqlite3.Connection], Any], Any] | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="diffusiond-job-db", daemon=True)
        self._thread.start()
        if (error := self._ready.get()) is not None:
            raise error

    # ---- the writer thread ----

    def _main(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # a crash of the process loses nothing; a power cut the last
            migrate(conn)
        except (sqlite3.Error, JobDBError) as exc:
            self._ready.put(exc if isinstance(exc, JobDBError) else JobDBError(f"{self.path}: {exc}"))
            return
        self._ready.put(None)
        try:
            while (item := self._queue.get()) is not None:
                work, done = item
                try:
                    result = work(conn)
                except BaseException as exc:  # to the caller, which decides
                    done(None, exc)
                else:
                    done(result, None)
        finally:
            conn.close()

    def _submit(self, work: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, exc: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if exc is not None:
                    future.set_exception(exc)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._queue.put((work, done))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    # ---- jobs ----

    async def put(self, job_id: str, tenant: str, status: str, params: bytes, job: bytes) -> None:
        """A new job, durable once this returns."""
        now = time.time()

        def insert(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO jobs (id, tenant, status, params, job, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job_id, tenant, status, params, job, now, now),
            )

        await self._submit(insert)

    def update(self, job_id: str, status: str, job: bytes) -> asyncio.Future[None]:
        """A job's new status (in the order given: one writer)."""
        now = time.time()

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE jobs SET status = ?, job = ?, updated_at = ? WHERE id = ?", (status, job, now, job_id))

        future = self._submit(write)
        future.add_done_callback(_logged)
        return future

    def delete(self, job_id: str) -> asyncio.Future[None]:
        future = self._submit(lambda conn: conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,)) and None)
        future.add_done_callback(_logged)
        return future

    async def unfinished(self) -> list[tuple[str, str, bytes, bytes]]:
        """(id, tenant, params, job) of every job not finished, oldest first."""

        def read(conn: sqlite3.Connection) -> list[tuple[str, str, bytes, bytes]]:
            marks = ",".join("?" * len(UNFINISHED))
            rows = conn.execute(
                f"SELECT id, tenant, params, job FROM jobs WHERE status IN ({marks}) ORDER BY created_at", UNFINISHED
            )
            return list(rows)

        return await self._submit(read)

    async def status(self, job_id: str) -> str | None:
        def read(conn: sqlite3.Connection) -> str | None:
            row = conn.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return row[0] if row else None

        return await self._submit(read)


def migrate(conn: sqlite3.Connection) -> int:
    """Every migration not applied yet, each in its own transaction; the schema's version."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    version = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]
    if version > len(MIGRATIONS):
        raise JobDBError(
            f"the job database is at schema version {version}, written by a newer diffusiond (this one knows "
            f"{len(MIGRATIONS)}); use that version, or another --state-dir"
        )
    for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in filter(str.strip, script.split(";")):
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (number, time.time()))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        log.info("job database: schema version %d", number)
    return len(MIGRATIONS)


def _logged(future: asyncio.Future) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("job database: a write failed: %s", exc)
