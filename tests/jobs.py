"""Helpers for tests of `/v1/videos` jobs run against daemons in processes (tests/daemon/test_job_db.py,
tests/deploy/test_shared_jobs.py): plain urllib calls, polling, and the frames of an MP4.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from jobs import ...`.
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import av
import numpy as np


def call(method: str, url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


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
