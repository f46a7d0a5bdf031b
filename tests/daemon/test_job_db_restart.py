"""A PostgreSQL job database that restarts under a serving daemon (issue 53, item 1). Before: the daemon held one
connection for its life, so after a restart every call raised, `POST`/`GET /v1/videos` answered 500 for good,
leases stopped renewing and `/ready` stayed 200. Now the database's writer connects again (daemon/job_db.py
`DatabaseAway`): while the database is away, the job routes answer 503 `database_unavailable` with Retry-After and
`/ready` says so; once it is back, a job is accepted within seconds, and a job that ran across the outage completes
once, its lease renewed."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from jobs import call, job, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

CLIP = {"prompt": "a clip", "size": "64x64", "num_frames": 5, "num_inference_steps": 2}


def ready(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{base}/ready", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_daemon_comes_back_with_its_database(tiny_wan, tmp_path):
    import psycopg
    from conftest import ServerThread
    from needs import missing
    from pg import Postgres, binaries

    from diffusiond.daemon.config import ServeConfig
    from diffusiond.daemon.videos_api import VIDEOS

    if binaries() is None:
        missing("needs Debian's postgresql (.ci/run installs it)")
    pg = Postgres()
    try:
        url = pg.database()
        config = ServeConfig(
            port=0, model=tiny_wan, state_url=url, state_dir=str(tmp_path / "shared"), job_lease=1.0,
            max_pixels=64 * 64, max_steps=2000,
        )  # fmt: skip
        # A server of this test's own, stopped with its database (the session's are kept to the end).
        thread = ServerThread(config, tiny_wan)
        server = thread.start()
        base = server.base_url
        status, body = call("POST", f"{base}/v1/videos", {**CLIP, "seed": 1})
        assert status == 200, body
        wait_all(base, [json.loads(body)["id"]], "completed", 60)
        # A long job runs across the outage (its steps need no database; its lease renewals fail meanwhile).
        status, body = call("POST", f"{base}/v1/videos", {**CLIP, "num_inference_steps": 1000, "seed": 2})
        assert status == 200, body
        long = json.loads(body)["id"]
        completed_before = server.call(lambda: server.state.engine.steps)

        pg.halt()
        t0 = time.monotonic()
        statuses = []
        while time.monotonic() - t0 < 2.0:
            status, body = call("POST", f"{base}/v1/videos", {**CLIP, "seed": 3})
            statuses.append(status)
            assert status == 503, body  # never 500
            assert json.loads(body)["error"]["code"] == "database_unavailable", body
            time.sleep(0.2)
        assert ready(base)[0] == 503 and ready(base)[1]["status"] == "database_unavailable"
        assert call("GET", f"{base}/v1/videos")[0] == 503
        # The long job completes while the database is away (its completion cannot be written), and stays away
        # past its lease: written again once the database is back, it must not look unfinished and run again.
        store = server.app[VIDEOS].store
        deadline = time.monotonic() + 60
        while server.call(lambda: store.jobs[long].status) != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.5)  # past its lease (1 s)

        pg.resume()
        t0 = time.monotonic()
        while (status := call("POST", f"{base}/v1/videos", {**CLIP, "seed": 4}))[0] != 200:
            assert status[0] == 503, status
            assert time.monotonic() - t0 < 10, "no job accepted within 10 s of the database's return"
            time.sleep(0.2)
        print(f"a job accepted {time.monotonic() - t0:.1f} s after the database came back")
        after = json.loads(status[1])["id"]
        assert ready(base) == (200, ready(base)[1])
        wait_all(base, [after, long], "completed", 120)
        time.sleep(2.0)  # a lease and a few claims later
        assert job(base, long)["status"] == "completed"
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT status FROM jobs WHERE id = %s", (long,)).fetchone() == ("completed",)
        # Run once: the engine stepped its 1000 steps once (the 2-step jobs rode along), none again from the start.
        steps = server.call(lambda: server.state.engine.steps) - completed_before
        assert steps < 1000 + 100, steps
        thread.stop()
    finally:
        pg.stop()
