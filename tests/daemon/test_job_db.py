"""Durable video jobs (`--state-dir`, daemon/job_db.py). The daemon is killed (SIGKILL) with 2 completed, 2 running
and 3 queued jobs; after a restart on the same folder the completed ones download byte-identical, the 5 others run
again from the start and complete with the videos an uninterrupted run makes (the same seeds: the same frames), each
job completes exactly once and none is duplicated; their POSTs sent again with their Idempotency-Keys after the
restart answer the same jobs (another body: 422). Broken on purpose once: without `readmit`, the 5 stayed unknown
after the restart (404, red). The schema: versioned, forward-only, a newer database refused."""

from __future__ import annotations

import http.client
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from jobs import call, content, frames, job, wait_all
from procs import free_port, kill_tree, ready, wait_ready

from diffusiond.daemon.job_db import JobDB
from diffusiond.daemon.job_schema import MIGRATIONS, JobDBError, migrate
from diffusiond.daemon.videos_api import VIDEOS
from diffusiond.models.default import default_model

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def start(model: str, state: str, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", model, "--port", str(port), "--state-dir", state,
           "--max-batch", "2", "--max-pixels", str(64 * 64), "--max-steps", "1000"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    env.update(OMP_NUM_THREADS="1", DIFFUSIOND_CACHE=os.environ.get("DIFFUSIOND_CACHE", ""))
    env = {k: v for k, v in env.items() if v}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_a_second_daemon_on_one_state_dir_refuses_to_start(tmp_path):
    """Two daemons on one --state-dir both called themselves `local` and took each other's jobs: the second now
    exits 2 naming the first's pid, before it loads anything; once the first is killed (-9: no clean-up), the
    folder is free again."""
    state = str(tmp_path / "state")
    model = str(default_model())
    logs = [open(tmp_path / f"daemon{i}.log", "w+") for i in range(3)]  # noqa: SIM115 - closed below
    first = start(model, state, free_port(), logs[0])
    try:
        base = f"http://127.0.0.1:{first.args[first.args.index('--port') + 1]}"
        wait_ready(base, first)
        t0 = time.monotonic()
        second = start(model, state, free_port(), logs[1])
        try:
            assert second.wait(60) == 2
        finally:
            if second.poll() is None:  # it started after all: not left behind
                kill_tree(second)
        assert time.monotonic() - t0 < 30
        logs[1].seek(0)
        said = logs[1].read()
        assert f"in use by another daemon (pid {first.pid})" in said and "Traceback" not in said, said
        assert ready(base)  # the first serves on
    finally:
        kill_tree(first)
    port = free_port()
    third = start(model, state, port, logs[2])
    try:
        wait_ready(f"http://127.0.0.1:{port}", third)
    finally:
        kill_tree(third)
        for log in logs:
            log.close()


def recorded(db: Path, request_id: str, timeout: float = 10.0) -> None:
    """Returns once the daemon's database holds the request's record (read beside the daemon, as sqlite allows)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            if conn.execute("SELECT 1 FROM requests WHERE id = ?", (request_id,)).fetchone():
                return
        finally:
            conn.close()
        assert time.monotonic() < deadline, f"request {request_id} never reached {db}"
        time.sleep(0.01)


def test_jobs_survive_a_kill(tiny_wan, tmp_path):
    state = str(tmp_path / "state")
    clip = {"prompt": "a clip", "size": "64x64", "num_frames": 5}
    short = [{**clip, "num_inference_steps": 2, "seed": s} for s in (1, 2)]
    # Long enough that the two running jobs are still running when the daemon is killed: a step of this clip took
    # 2.7 ms at batch 2 here (150 steps finished before the kill once, and the test was wrong, not the daemon).
    long = [{**clip, "num_inference_steps": 400, "seed": s} for s in (10, 11, 12, 13, 14)]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115 - closed below
    proc = start(tiny_wan, state, port, log)
    try:
        wait_ready(base, proc)
        done = [json.loads(call("POST", f"{base}/v1/videos", b)[1])["id"] for b in short]
        wait_all(base, done, "completed", 60)
        kept = {i: content(base, i) for i in done}
        pending = []
        for n, body in enumerate(long):
            status, answer = call("POST", f"{base}/v1/videos", body, {"Idempotency-Key": f"k{n}"})
            assert status == 200, answer
            pending.append(json.loads(answer)["id"])
        deadline = time.monotonic() + 30
        while [job(base, i)["status"] for i in pending].count("in_progress") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        statuses = [job(base, i)["status"] for i in pending]
        assert statuses.count("in_progress") == 2 and statuses.count("queued") == 3, statuses
        # A native stream waiting behind them when the daemon dies: its connection goes with it.
        stream = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        native = {"prompt": "a stream", "width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 400}
        stream.request("POST", "/v1/generations", json.dumps(native).encode(), {"Content-Type": "application/json"})
        cut = stream.getresponse().headers["X-Request-Id"]
        recorded(Path(state) / "diffusiond.db", cut)  # written off the event loop, not waited for
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        stream.close()

        proc = start(tiny_wan, state, port, log)
        wait_ready(base, proc)
        # Request records are kept too: the completed jobs' requests say so, the cut stream's says what happened.
        for i in done:
            status, body = call("GET", f"{base}/v1/generations/{i.removeprefix('video_')}")
            assert status == 200 and json.loads(body)["status"] == "completed", body
        status, body = call("GET", f"{base}/v1/generations/{cut}")
        record = json.loads(body)
        assert status == 200 and record["status"] == "failed" and "restart or a crash" in record["error"], body
        for i in done:  # served from their files, byte-identical
            assert job(base, i)["status"] == "completed" and content(base, i) == kept[i]
        # Idempotency keys are kept with the jobs: a retry after the restart gets its first try's job.
        for n, body in enumerate(long):
            status, answer = call("POST", f"{base}/v1/videos", body, {"Idempotency-Key": f"k{n}"})
            assert status == 200 and json.loads(answer)["id"] == pending[n], answer
        status, answer = call("POST", f"{base}/v1/videos", short[0], {"Idempotency-Key": "k0"})
        assert status == 422 and b"idempotency_key_reused" in answer, answer
        wait_all(base, pending, "completed", 240)
        rerun = {i: content(base, i) for i in pending}
        # An uninterrupted run of the same requests: the same videos.
        again = [json.loads(call("POST", f"{base}/v1/videos", b)[1])["id"] for b in long]
        wait_all(base, again, "completed", 240)
        uninterrupted = [frames(content(base, j)) for j in again]
        for n, i in enumerate(pending):
            a = frames(rerun[i])
            diffs = [float(np.abs(a.astype(int) - b.astype(int)).mean()) for b in uninterrupted]
            print(f"{i} rerun: mean abs diff to each uninterrupted video {[round(d, 2) for d in diffs]}")
            assert diffs[n] == min(diffs) and diffs[n] <= 1.0, (i, diffs)
        status, listing = call("GET", f"{base}/v1/videos?limit=100")
        ids = [j["id"] for j in json.loads(listing)["data"]]
        assert sorted(ids) == sorted(done + pending + again)  # none lost, none twice
    finally:
        kill_tree(proc)
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert "5 left unfinished by the previous run, admitted again" in text, text[-3000:]
    for i in pending:  # each rerun job's request completed once (its first run was killed before the end)
        assert text.count(f"request {i.removeprefix('video_')} completed") == 1, i
    rows = sqlite3.connect(tmp_path / "state" / "diffusiond.db").execute("SELECT status FROM jobs").fetchall()
    assert sorted(r[0] for r in rows) == ["completed"] * 12


def test_the_schema_is_versioned_and_a_newer_one_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    known = len(MIGRATIONS["sqlite"])
    assert migrate(conn) == known and migrate(conn) == known  # forward-only, idempotent
    versions = [v for (v,) in conn.execute("SELECT version FROM schema_version ORDER BY version")]
    assert versions == list(range(1, len(MIGRATIONS["sqlite"]) + 1))
    conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, 0)", (len(MIGRATIONS["sqlite"]) + 1,))
    conn.close()
    with pytest.raises(JobDBError, match="written by a newer diffusiond"):
        JobDB(tmp_path / "a.db")


@pytest.mark.asyncio
async def test_every_commit_is_synced_before_it_returns(tmp_path):
    """ "Durable once this returns": the daemon's own connection syncs each commit (synchronous FULL, 2); NORMAL (1),
    as before, synced the WAL only at checkpoints, so a power cut could lose a job whose id its client held."""
    db = JobDB(tmp_path / "a.db")
    try:
        assert await db._run("PRAGMA synchronous") == [(2,)]
        assert await db._run("PRAGMA journal_mode") == [("wal",)]
    finally:
        db.close()


def test_a_run_past_its_lease_publishes_nothing(serve, tiny_wan, tmp_path, caplog):
    """A replica that stalls past its lease and finishes its job anyway must not publish: another replica took the
    job over and publishes its own run under the same names. Here the takeover is written into the job database
    while the job runs (as a claim by another replica would), with leases so long that this daemon's renewal, which
    would cancel the job, does not come first: the run finishes, its video is staged under names of its own and
    discarded at the fence (`holds`), the job's row stays the other replica's, and no file is left (red without the
    fence: the MP4 was published and the job said completed)."""
    state = tmp_path / "state"
    server = serve(model=tiny_wan, state_dir=str(state), job_lease=3600.0, max_pixels=64 * 64)
    base = server.base_url
    status, body = call("POST", f"{base}/v1/videos", {"prompt": "a clip", "size": "64x64", "num_frames": 5,
                                                       "num_inference_steps": 400, "seed": 3})  # fmt: skip
    assert status == 200, body
    job_id = json.loads(body)["id"]
    conn = sqlite3.connect(state / "diffusiond.db", timeout=10)
    try:
        changed = conn.execute(
            "UPDATE jobs SET lease_owner = 'replica-b' WHERE id = ? AND status IN ('queued', 'in_progress')", (job_id,)
        ).rowcount
        conn.commit()
        assert changed == 1, "the job finished before the takeover: give it more steps"
        deadline = time.monotonic() + 60
        while server.call(lambda: job_id in server.app[VIDEOS].tasks):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        row = conn.execute("SELECT status, lease_owner FROM jobs WHERE id = ?", (job_id,)).fetchone()
    finally:
        conn.close()
    assert row[1] == "replica-b" and row[0] in ("queued", "in_progress"), row  # (its writes fenced since)
    assert any("this run's video is discarded" in r.getMessage() for r in caplog.records)
    assert [p.name for p in (state / "videos").iterdir() if p.name.startswith(job_id)] == []
