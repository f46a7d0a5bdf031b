"""Leases on video jobs (daemon/job_db.py), in SQLite and in a real PostgreSQL server: the replica that created a
job holds it while it renews; no other replica claims it before the lease runs out; once it has, the first
replica's writes change nothing (fenced) and its renewal says the job is gone; five replicas claiming one orphan at
once get it once. Broken on purpose once: with the lease condition dropped from `claim`, a second replica took a
job its creator still held (red)."""

from __future__ import annotations

import asyncio
import time

import pytest

from diffusiond.daemon.job_db import JobDB
from diffusiond.daemon.job_schema import MIGRATIONS, JobDBError

LEASE = 1.0


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path):
    if request.param == "sqlite":
        return tmp_path / "jobs.db"
    return request.getfixturevalue("postgres").database()


def open_db(target, replica: str, lease: float = LEASE) -> JobDB:
    return JobDB(target, replica=replica, lease_s=lease)


async def put(db: JobDB, job_id: str, tenant: str = "alice") -> None:
    await db.put(job_id, tenant, "queued", b'{"seed": 1}', f'{{"id": "{job_id}"}}'.encode())


def test_a_lease_keeps_others_off_until_it_runs_out(target):
    a, b = open_db(target, "a"), open_db(target, "b")

    async def scenario() -> None:
        await put(a, "video_1")
        assert await b.claim(10) == []  # a holds it
        await asyncio.sleep(LEASE * 0.6)
        assert await a.renew({"video_1": b'{"progress": 40}'}) == {"video_1"}
        await asyncio.sleep(LEASE * 0.6)
        assert await b.claim(10) == []  # renewed: a holds it still, past its first lease's end
        assert await b.get("video_1") == ("alice", b'{"progress": 40}')  # the progress a wrote, for b to report
        await asyncio.sleep(LEASE * 1.2)  # a stopped renewing (it died, or stalled)
        (claimed,) = await b.claim(10)
        assert claimed == ("video_1", "alice", b'{"seed": 1}', b'{"progress": 40}')
        # a comes back: its writes change nothing, and its renewal says the job is not its own.
        assert await a.update("video_1", "completed", b"{}", time.time()) == 0
        assert await a.renew({"video_1": b"{}"}) == set()
        assert await a.status("video_1") == "queued"
        assert await b.update("video_1", "completed", b"{}", time.time() + 60) == 1
        assert await a.claim(10) == []  # finished jobs are nobody's to claim

    try:
        asyncio.run(scenario())
    finally:
        a.close()
        b.close()


def test_a_replica_restarted_under_its_id_takes_its_jobs_back_at_once(target):
    a, b = open_db(target, "a", lease=60.0), open_db(target, "b", lease=60.0)

    async def scenario() -> None:
        await put(a, "video_1")
        await put(a, "video_2")
        await put(b, "video_3")
        a.close()  # killed
        again = open_db(target, "a", lease=60.0)
        try:
            assert await again.claim(10) == []  # its leases have not run out
            assert [r[0] for r in await again.claim(10, mine=True)] == ["video_1", "video_2"]  # b's stays b's
            assert await b.release() == 1
            assert [r[0] for r in await again.claim(10)] == ["video_3"]  # released at b's drain: at once
        finally:
            again.close()

    try:
        asyncio.run(scenario())
    finally:
        b.close()


def test_replicas_claiming_one_orphan_at_once_get_it_once(target):
    creator = open_db(target, "creator", lease=0.2)
    claimers = [open_db(target, f"r{i}") for i in range(5)]

    async def scenario() -> None:
        for n in range(3):
            await put(creator, f"video_{n}")
        await asyncio.sleep(0.3)
        results = await asyncio.gather(*(c.claim(10) for c in claimers))
        ids = sorted(r[0] for rows in results for r in rows)
        assert ids == ["video_0", "video_1", "video_2"], ids  # each job claimed exactly once

    try:
        asyncio.run(scenario())
    finally:
        for db in (creator, *claimers):
            db.close()


def test_finished_jobs_expire_once_whichever_replica_asks(target):
    a, b = open_db(target, "a"), open_db(target, "b")

    async def scenario() -> None:
        await put(a, "video_1")
        await put(a, "video_2")
        assert await a.update("video_1", "completed", b"done", time.time() - 1) == 1
        assert await a.update("video_2", "completed", b"later", time.time() + 3600) == 1
        expired = await asyncio.gather(a.expire(), b.expire())
        assert sorted(expired, key=len) == [[], [b"done"]]  # one replica removes its files
        assert await a.get("video_1") is None and await a.get("video_2") is not None
        assert [await x for x in (a.listing("alice"), a.listing("bob"))] == [[b"later"], []]

    try:
        asyncio.run(scenario())
    finally:
        a.close()
        b.close()


def test_an_idempotency_key_names_its_first_job_on_every_replica(target):
    a, b = open_db(target, "a"), open_db(target, "b")

    async def scenario() -> None:
        ident = ("alice", "/v1/videos", "k1")
        assert await a.remember_key(*ident, "body1", "video_1", 3600) == ("body1", "video_1")  # first use: runs
        assert await b.remember_key(*ident, "body1", "video_2", 3600) == ("body1", "video_1")  # a repeat, elsewhere
        assert await b.remember_key(*ident, "body2", "video_3", 3600) == ("body1", "video_1")  # another body: 422
        assert await b.remember_key("bob", "/v1/videos", "k1", "body1", "video_4", 3600) == ("body1", "video_4")
        await a.forget_key(*ident, "video_1")  # its first use failed: the next try runs
        assert await b.remember_key(*ident, "body1", "video_5", 3600) == ("body1", "video_5")
        await asyncio.sleep(0.05)
        assert await a.remember_key(*ident, "body1", "video_6", 0.01) == ("body1", "video_6")  # past the window
        await asyncio.sleep(0.05)
        assert await a.expire_keys(0.01) == 2 and await a.expire_keys(0.01) == 0  # bob's, and alice's (video_6)
        assert await a.remember_key(*ident, "body1", "video_7", 3600) == ("body1", "video_7")

    try:
        asyncio.run(scenario())
    finally:
        a.close()
        b.close()


def test_the_schema_is_versioned_in_both_dialects(target):
    db = open_db(target, "a")
    db.close()
    # Forward-only, idempotent: a second start finds it done; a newer schema is refused.
    db = open_db(target, "b")

    async def newer() -> None:
        newest = len(MIGRATIONS["sqlite"]) + 1
        await db._run("INSERT INTO schema_version (version, applied_at) VALUES (?, 0)", (newest,))

    asyncio.run(newer())
    db.close()
    with pytest.raises(JobDBError, match="written by a newer diffusiond"):
        open_db(target, "c")
