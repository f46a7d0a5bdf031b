"""Tenants on the job database's stores (issue 53, item 5): a job and a request record read back from SQLite after a
restart, and from PostgreSQL by another replica (neither in the reading process's memory), are the tenant's alone:
another tenant gets 404 on every route that names them and an empty listing, as for ids never given. On the tiny
Wan checkpoint. Broken on purpose: with the tenant dropped from the job database's listing query, bob's list showed
alice's job through the other replica (PostgreSQL, red); with it dropped from the store's listing, after the restart
(SQLite, red)."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request

import pytest
from conftest import ServerThread

from diffusiond.daemon.config import ServeConfig

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

KEYS = {"alice": "alice-key", "bob": "bob-key"}


def call(base: str, method: str, path: str, name: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEYS[name]}", "Content-Type": "application/json"}
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_records_read_back_from_the_job_database_are_their_tenant_s(store, tiny_wan, tmp_path, request):
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "".join(f'[tenants.{n}]\nkey_sha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n' for n, k in KEYS.items())
    )
    folder = tmp_path / "state"
    url = request.getfixturevalue("postgres").database() if store == "postgresql" else None
    options = {"api_keys_file": str(keys), "state_dir": str(folder), "max_pixels": 64 * 64, "state_url": url}

    def server(replica: str) -> tuple[ServerThread, str]:
        thread = ServerThread(ServeConfig(port=0, model=tiny_wan, replica_id=replica, **options), tiny_wan)
        return thread, thread.start().base_url

    first, base = server("a")
    clip = {"prompt": "a cat", "size": "64x64", "num_frames": 5, "num_inference_steps": 1, "seed": 1}
    status, body = call(base, "POST", "/v1/videos", "alice", clip)
    assert status == 200, body
    job = json.loads(body)
    deadline = time.monotonic() + 60
    while json.loads(call(base, "GET", f"/v1/videos/{job['id']}", "alice")[1])["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rid = job["id"].removeprefix("video_")
    if store == "sqlite":  # the same folder after a restart (one daemon per --state-dir)
        first.stop()
        second, other = server("a")
    else:  # another replica on the same table and folder, the first still running
        second, other = server("b")
    try:
        for path in (f"/v1/videos/{job['id']}", f"/v1/videos/{job['id']}/content", f"/v1/generations/{rid}"):
            assert call(other, "GET", path, "bob")[0] == 404, path
            assert call(other, "GET", path, "alice")[0] == 200, path
        assert json.loads(call(other, "GET", "/v1/videos", "bob")[1])["data"] == []
        assert [j["id"] for j in json.loads(call(other, "GET", "/v1/videos", "alice")[1])["data"]] == [job["id"]]
        assert call(other, "DELETE", f"/v1/videos/{job['id']}", "bob")[0] == 404
        assert call(other, "GET", f"/v1/videos/{job['id']}", "alice")[0] == 200  # bob's DELETE removed nothing
    finally:
        second.stop()
        if store == "postgresql":
            first.stop()
