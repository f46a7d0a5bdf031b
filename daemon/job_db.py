"""Video jobs that survive the daemon (issue 33, part 2): their records in SQLite (`--state-dir DIR`:
`DIR/diffusiond.db`, WAL), or in PostgreSQL (`--state-url postgresql://...`), which replicas share; written by one
thread of their own, never on the event loop.

A job is written before its creation is answered (a client that got an id can count on it), with the parameters it
runs with (the seed resolved, so that a rerun makes the same video), then again at each change of status. The
schema is versioned (`schema_version`, forward-only migrations); a database from a newer diffusiond is refused.

Who runs a job: the replica that holds its lease (`lease_owner`, `lease_until` on the database's clock). The replica
that creates a job takes the lease with the row; while the job is unfinished, it renews the lease every third of
`lease_s` (`renew`), and every write of the job's status is fenced by it (`update` changes nothing once another
replica holds the lease). A replica that dies stops renewing: once the lease runs out, another replica's `claim`
takes the job (one UPDATE over the rows it selects; PostgreSQL's `FOR UPDATE SKIP LOCKED`, SQLite's single writer)
and runs it again from the start; a replica that comes back under the same id (`--replica-id`, by default host and
port) takes its own jobs back at once. A replica that finds a job it runs no longer its own (its lease ran out
while it stalled, or the job was deleted) cancels it: two replicas never both finish one job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from diffusiond.daemon.job_schema import Dialect, JobDBError, connect, migrate

log = logging.getLogger(__name__)

T = TypeVar("T")

UNFINISHED = ("queued", "in_progress")
FINISHED = ("completed", "failed", "cancelled")


class DatabaseAway(JobDBError):
    """The shared database cannot be reached now (a restart, a failover): answered 503 with Retry-After, and the
    writer connects again (RECONNECT_S between tries) at the next work."""


# Seconds between tries to connect again to a database that went away, and the connection timeout of each try.
RECONNECT_S = 1.0
RECONNECT_TIMEOUT_S = 2


def _broken(conn: Any) -> bool:
    """Whether a PostgreSQL connection is lost (psycopg's `broken`: the server went away), not just a failed
    statement."""
    return bool(getattr(conn, "broken", False) or getattr(conn, "closed", False))


def database_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (sqlite3.Error, DatabaseAway)
    try:
        import psycopg
    except ImportError:
        return errors
    return (*errors, psycopg.Error)


class JobDB:
    """`target`: a SQLite file, or a PostgreSQL URL (`shared`: replicas use it together). `replica`: this
    replica's name in the leases; `lease_s`: how long a lease lasts unrenewed."""

    def __init__(self, target: Path | str, *, replica: str = "local", lease_s: float = 30.0) -> None:
        self.target = target
        self.replica = replica
        self.lease_s = lease_s
        self.shared = isinstance(target, str)
        self.dialect = Dialect("postgresql" if self.shared else "sqlite")
        self._queue: queue.SimpleQueue[tuple[Callable[[Any], Any], Any] | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        # Why the shared database cannot be reached (None: it can), and when the writer may try it again.
        self.away: str | None = None
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._main, name="diffusiond-job-db", daemon=True)
        self._thread.start()
        if (error := self._ready.get()) is not None:
            raise error

    def __repr__(self) -> str:  # never the URL: it may hold a password
        return f"JobDB({self.dialect.name}, replica={self.replica!r})"

    # ---- the writer thread ----

    def _main(self) -> None:
        conn = None
        try:
            conn, _ = connect(self.target)
            migrate(conn, self.dialect)
        except (*database_errors(), JobDBError) as exc:
            if conn is not None:
                conn.close()
            self._ready.put(exc if isinstance(exc, JobDBError) else JobDBError(f"{self.dialect.name}: {exc}"))
            return
        self._ready.put(None)
        try:
            while (item := self._queue.get()) is not None:
                work, done = item
                if conn is None and (conn := self._reconnect()) is None:
                    done(None, DatabaseAway(f"the job database cannot be reached: {self.away}"))
                    continue
                try:
                    result = work(conn)
                except BaseException as exc:  # to the caller, which decides
                    if self.shared and _broken(conn):
                        self._lost(conn, exc)
                        conn = None
                        exc = DatabaseAway(f"the job database went away: {exc}")
                    done(None, exc)
                else:
                    done(result, None)
        finally:
            if conn is not None:
                conn.close()

    def _lost(self, conn: Any, exc: BaseException) -> None:
        """The shared database went away: its connection closed, the next work connects again."""
        log.warning("job database: the connection is lost (%s); connecting again", exc)
        with contextlib.suppress(Exception):
            conn.close()
        self.away, self._next_try = str(exc).strip() or type(exc).__name__, 0.0

    def _reconnect(self) -> Any:
        """A new connection to the shared database, or None (at most a try per RECONNECT_S: work meanwhile fails
        at once, not after a connection timeout each)."""
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + RECONNECT_S
        try:
            conn, _ = connect(self.target, timeout=RECONNECT_TIMEOUT_S)
        except (*database_errors(), JobDBError) as exc:
            self.away = str(exc).strip() or type(exc).__name__
            return None
        log.info("job database: connected again")
        self.away = None
        return conn

    def _submit(self, work: Callable[[Any], T]) -> asyncio.Future[T]:
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

    def _run(self, query: str, args: Sequence[Any] = ()) -> asyncio.Future[Any]:
        """One statement; its rows (RETURNING, SELECT) or [] and, for others, how many rows it changed."""
        sql = self.dialect.sql(query)

        def work(conn: Any) -> Any:
            cursor = conn.execute(sql, tuple(args))
            if cursor.description is None:
                return cursor.rowcount
            return [tuple(row) for row in cursor.fetchall()]

        return self._submit(work)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    # ---- jobs ----

    async def put(self, job_id: str, tenant: str, status: str, params: bytes, job: bytes) -> None:
        """A new job, leased to this replica, durable once this returns."""
        now = time.time()
        await self._run(
            "INSERT INTO jobs (id, tenant, status, params, job, created_at, updated_at, lease_owner, lease_until) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, {now} + ?)",
            (job_id, tenant, status, params, job, now, now, self.replica, self.lease_s),
        )

    def update(self, job_id: str, status: str, job: bytes, expires_at: float | None = None) -> asyncio.Future[int]:
        """A job's new status (in the order given: one writer), written only while this replica holds its lease;
        how many rows it changed (0: the job is another replica's now, or deleted)."""
        future = self._run(
            "UPDATE jobs SET status = ?, job = ?, expires_at = ?, updated_at = ? WHERE id = ? AND lease_owner = ?",
            (status, job, expires_at, time.time(), job_id, self.replica),
        )
        future.add_done_callback(_logged)
        return future

    async def holds(self, job_id: str) -> bool:
        """Whether this replica holds the lease of unfinished job `job_id` (it may publish the job's video): a fenced
        write that changes nothing but `updated_at`."""
        changed = await self._run(
            "UPDATE jobs SET updated_at = ? WHERE id = ? AND lease_owner = ? AND status IN (?, ?)",
            (time.time(), job_id, self.replica, *UNFINISHED),
        )
        return changed > 0

    def delete(self, job_id: str) -> asyncio.Future[list[tuple]]:
        """Forgets a job; the `(job,)` it had, if any."""
        future = self._run("DELETE FROM jobs WHERE id = ? RETURNING job", (job_id,))
        future.add_done_callback(_logged)
        return future

    async def get(self, job_id: str) -> tuple[str, bytes] | None:
        """(tenant, job) of one job, whichever replica runs it."""
        rows = await self._run("SELECT tenant, job FROM jobs WHERE id = ?", (job_id,))
        return (rows[0][0], bytes(rows[0][1])) if rows else None

    async def listing(self, tenant: str) -> list[bytes]:
        """A tenant's jobs, in creation order."""
        rows = await self._run("SELECT job FROM jobs WHERE tenant = ? ORDER BY created_at, id", (tenant,))
        return [bytes(r[0]) for r in rows]

    async def finished_here(self) -> list[bytes]:
        """The jobs this replica finished (their records), for the webhooks a restart sends again (video_jobs.py)."""
        rows = await self._run(
            "SELECT job FROM jobs WHERE lease_owner = ? AND status IN ('completed', 'failed')", (self.replica,)
        )
        return [bytes(r[0]) for r in rows]

    async def status(self, job_id: str) -> str | None:
        rows = await self._run("SELECT status FROM jobs WHERE id = ?", (job_id,))
        return rows[0][0] if rows else None

    async def claim(self, limit: int, *, mine: bool = False) -> list[tuple[str, str, bytes, bytes]]:
        """(id, tenant, params, job) of up to `limit` unfinished jobs whose lease ran out (and, with `mine`, those
        this replica held before it restarted), now leased to this replica; oldest first."""
        if limit <= 0:
            return []
        marks = ",".join("?" * len(UNFINISHED))
        own = " OR lease_owner = ?" if mine else ""
        args: list[Any] = [self.replica, self.lease_s, *UNFINISHED]
        if mine:
            args.append(self.replica)
        rows = await self._run(
            "UPDATE jobs SET lease_owner = ?, lease_until = {now} + ? WHERE id IN ("
            f"SELECT id FROM jobs WHERE status IN ({marks}) AND (lease_until IS NULL OR lease_until < {{now}}{own}) "
            f"ORDER BY created_at LIMIT ?{self.dialect.skip_locked}) RETURNING id, tenant, params, job, created_at",
            (*args, limit),
        )
        return [(r[0], r[1], bytes(r[2]), bytes(r[3])) for r in sorted(rows, key=lambda r: r[4])]

    async def renew(self, held: dict[str, bytes]) -> set[str]:
        """Renews this replica's leases of the jobs it runs (`held`: id -> the job as it is now, its progress
        written with it); the ids it still holds (the others went to another replica, or were deleted)."""
        if not held:
            return set()

        def work(conn: Any) -> set[str]:
            kept = set()
            sql = self.dialect.sql(
                "UPDATE jobs SET lease_until = {now} + ?, job = ?, updated_at = ? "
                "WHERE id = ? AND lease_owner = ? AND status IN (?, ?)"
            )
            now = time.time()
            for job_id, job in held.items():
                if conn.execute(sql, (self.lease_s, job, now, job_id, self.replica, *UNFINISHED)).rowcount:
                    kept.add(job_id)
            return kept

        return await self._submit(work)

    async def release(self, job_id: str | None = None) -> int:
        """This replica's unfinished jobs (or one of them), free for any replica's next claim (at a drain; a job
        claimed that cannot be admitted now)."""
        marks = ",".join("?" * len(UNFINISHED))
        one = "" if job_id is None else " AND id = ?"
        return await self._run(
            f"UPDATE jobs SET lease_until = NULL WHERE lease_owner = ? AND status IN ({marks}){one}",
            (self.replica, *UNFINISHED, *([] if job_id is None else [job_id])),
        )

    async def expire(self) -> list[bytes]:
        """Forgets finished jobs whose time is up, whichever replica ran them; their jobs (whose files the caller
        removes: exactly one replica gets each)."""
        marks = ",".join("?" * len(FINISHED))
        rows = await self._run(
            f"DELETE FROM jobs WHERE status IN ({marks}) AND expires_at <= {{now}} RETURNING job", FINISHED
        )
        return [bytes(r[0]) for r in rows]

    async def expire_keys(self, window_s: float) -> int:
        return await self._run("DELETE FROM idempotency_keys WHERE created_at < {now} - ?", (window_s,))

    # ---- requests (every engine request: images, native streams, the videos' own) ----

    def journal(
        self, request_id: str, tenant: str, status: str, error: str | None, record: bytes, params: bytes | None
    ) -> None:
        """A request's record, admitted (`params` given) or ended; not waited for (one writer keeps the order)."""
        now = time.time()
        if params is not None:
            query = (
                "INSERT INTO requests (id, tenant, replica, status, error, params, record, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET replica = ?, status = ?, "
                "error = ?, record = ?, updated_at = ?"
            )
            args: tuple = (request_id, tenant, self.replica, status, error, params, record, now, now)
            args += (self.replica, status, error, record, now)
        else:
            query = "UPDATE requests SET status = ?, error = ?, record = ?, updated_at = ? WHERE id = ?"
            args = (status, error, record, now, request_id)
        sql = self.dialect.sql(query)

        def work(conn: Any) -> None:
            conn.execute(sql, args)

        def done(_: Any, exc: BaseException | None) -> None:  # on the writer thread
            if exc is not None:
                log.error("job database: a request's record was not written: %s", exc)

        self._queue.put((work, done))

    async def request(self, request_id: str) -> tuple[str, str, str | None, bytes] | None:
        """(tenant, status, error, record) of a request, whichever replica ran it."""
        rows = await self._run("SELECT tenant, status, error, record FROM requests WHERE id = ?", (request_id,))
        return (rows[0][0], rows[0][1], rows[0][2], bytes(rows[0][3])) if rows else None

    async def abandon_requests(self, why: str) -> int:
        """At the start: this replica's requests its previous run left unfinished, failed (their clients' connections
        went with it)."""
        return await self._run(
            "UPDATE requests SET status = 'failed', error = ?, updated_at = ? WHERE replica = ? "
            "AND status IN ('queued', 'running', 'paused')",
            (why, time.time(), self.replica),
        )

    async def expire_requests(self, older_s: float) -> int:
        return await self._run(
            "DELETE FROM requests WHERE status IN ('completed', 'failed', 'cancelled') AND updated_at < ?",
            (time.time() - older_s,),
        )

    # ---- idempotency keys of the POSTs that create jobs ----

    async def remember_key(
        self, tenant: str, route: str, key: str, fingerprint: str, job_id: str, window_s: float
    ) -> tuple[str, str]:
        """(fingerprint, job id) the key names: `job_id` and `fingerprint` if this is the key's first use (within
        `window_s`), else the first use's, whichever replica saw it."""
        ident = (tenant, route, key)

        def work(conn: Any) -> tuple[str, str]:
            sql = self.dialect.sql
            conn.execute(
                sql(
                    "DELETE FROM idempotency_keys WHERE tenant = ? AND route = ? AND key = ? AND created_at < {now} - ?"
                ),
                (*ident, window_s),
            )
            conn.execute(
                sql(
                    "INSERT INTO idempotency_keys (tenant, route, key, fingerprint, job_id, created_at) "
                    "VALUES (?, ?, ?, ?, ?, {now}) ON CONFLICT DO NOTHING"
                ),
                (*ident, fingerprint, job_id),
            )
            row = conn.execute(
                sql("SELECT fingerprint, job_id FROM idempotency_keys WHERE tenant = ? AND route = ? AND key = ?"),
                ident,
            ).fetchone()
            return row[0], row[1]

        return await self._submit(work)

    def forget_key(self, tenant: str, route: str, key: str, job_id: str) -> asyncio.Future[Any]:
        """A key whose first use made no job (an error): the next try runs."""
        future = self._run(
            "DELETE FROM idempotency_keys WHERE tenant = ? AND route = ? AND key = ? AND job_id = ?",
            (tenant, route, key, job_id),
        )
        future.add_done_callback(_logged)
        return future


def _logged(future: asyncio.Future) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        # Away: written again once it is back (video_jobs.py VideoJobs.unwritten).
        (log.warning if isinstance(exc, DatabaseAway) else log.error)("job database: a write failed: %s", exc)
