"""Durable video jobs (`--state-dir`, daemon/job_db.py). The daemon is killed (SIGKILL) with 2 completed, 2 running
and 3 queued jobs; after a restart on the same folder the completed ones download byte-identical, the 5 others run
again from the start and complete with the videos an uninterrupted run makes (the same seeds: the same frames), each
job completes exactly once and none is duplicated. Broken on purpose once: without `readmit`, the 5 stayed unknown
after the restart (404, red). The schema: versioned, forward-only, a newer database refused."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request

import av
import numpy as np
import pytest
from procs import free_port, kill_tree, wait_ready

from diffusiond.daemon.job_db import MIGRATIONS, JobDB, JobDBError, migrate

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def call(method: str, url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start(model: str, state: str, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", model, "--port", str(port), "--state-dir", state,
           "--max-batch", "2", "--max-pixels", str(64 * 64), "--max-steps", "1000"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    env.update(OMP_NUM_THREADS="1", DIFFUSIOND_CACHE=os.environ.get("DIFFUSIOND_CACHE", ""))
    env = {k: v for k, v in env.items() if v}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def job(base: str, job_id: str) -> dict:
    status, body = call("GET", f"{base}/v1/videos/{job_id}")
    assert status == 200, (job_id, status, body[:300])
    return json.loads(body)


def wait_all(base: str, ids: list[str], status: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not all(job(base, i)["status"] == status for i in ids):
        assert time.monotonic() < deadline, [job(base, i)["status"] for i in ids]
        time.sleep(0.1)


def frames(mp4: bytes) -> np.ndarray:
    """The decoded frames of an MP4 (its bytes also hold the time it was written)."""
    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


def content(base: str, job_id: str) -> bytes:
    status, body = call("GET", f"{base}/v1/videos/{job_id}/content")
    assert status == 200, (job_id, status)
    return body


def test_jobs_survive_a_kill(tiny_wan, tmp_path):
    state = str(tmp_path / "state")
    clip = {"prompt": "a clip", "size": "64x64", "num_frames": 5}
    short = [{**clip, "num_inference_steps": 2, "seed": s} for s in (1, 2)]
    long = [{**clip, "num_inference_steps": 150, "seed": s} for s in (10, 11, 12, 13, 14)]
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
        for body in long:
            status, answer = call("POST", f"{base}/v1/videos", body)
            assert status == 200, answer
            pending.append(json.loads(answer)["id"])
        deadline = time.monotonic() + 30
        while [job(base, i)["status"] for i in pending].count("in_progress") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        statuses = [job(base, i)["status"] for i in pending]
        assert statuses.count("in_progress") == 2 and statuses.count("queued") == 3, statuses
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

        proc = start(tiny_wan, state, port, log)
        wait_ready(base, proc)
        for i in done:  # served from their files, byte-identical
            assert job(base, i)["status"] == "completed" and content(base, i) == kept[i]
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
    assert migrate(conn) == len(MIGRATIONS) and migrate(conn) == len(MIGRATIONS)  # forward-only, idempotent
    versions = [v for (v,) in conn.execute("SELECT version FROM schema_version ORDER BY version")]
    assert versions == list(range(1, len(MIGRATIONS) + 1))
    conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, 0)", (len(MIGRATIONS) + 1,))
    conn.close()
    with pytest.raises(JobDBError, match="written by a newer diffusiond"):
        JobDB(tmp_path / "a.db")
