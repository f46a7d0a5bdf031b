"""Tenants (`--api-keys-file`, daemon/tenants.py): every route that names a request or a job answers another tenant
404, as an id that was never given; quotas answer 429 naming the quota; a reload adds and revokes keys while admitted
requests run on; per-tenant series count it all. Broken on purpose once: with the owner check taken out of
`_get_job` (daemon/videos_api.py), `test_a_tenant_sees_only_its_own_videos` went red at bob's GET."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from exposition import samples
from procs import free_port, kill_tree, wait_ready

from diffusiond.daemon.app import reload_tenants
from diffusiond.daemon.config import ConfigError, ServeConfig
from diffusiond.daemon.tenants import Tenants, TenantsError

TIMEOUT = aiohttp.ClientTimeout(total=60)
KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key"}
IMAGE = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 2, "seed": 0}
LONG = {"prompt": "a long one", "width": 64, "height": 64, "num_inference_steps": 1000, "seed": 1}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_tenants(path: Path, tenants: dict[str, dict]) -> Path:
    lines = []
    for name, quotas in tenants.items():
        lines += [f"[tenants.{name}]", f'key_sha256 = "{sha(KEYS[name])}"']
        lines += [f"{field} = {json.dumps(value)}" for field, value in quotas.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def status_as(url: str, name: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth(name)), timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


# ---- the file ----


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tenants.a]\nkey_sha256 = "abc"\n', "tenants.a: Expected `str` matching regex"),
        (f'[tenants.a]\nkey_sha256 = "{sha("k")}"\nmax_in_flight = -1\n', "Expected `int` >= 0"),
        (f'[tenants.a]\nkey_sha256 = "{sha("k")}"\nmax_inflight = 1\n', "unknown field `max_inflight`"),
        ("[tenants.a]\nmax_queued = 1\n", "tenants.a: key_sha256 (or keys_sha256) is required"),
        (f'[tenants.a]\nkey_sha256 = "{sha("k")}"\n[tenants.b]\nkey_sha256 = "{sha("k")}"\n', "a key of tenants.a"),
        (f'[tenants."a b"]\nkey_sha256 = "{sha("k")}"\n', "tenant name 'a b'"),
        (f'[tenants.a]\nkey_sha256 = "{sha("k")}"\npriority = [5, 0]\n', "priority: [5, 0] is empty"),
        ('[tenant.a]\nkey_sha256 = "x"\n', "expected [tenants.NAME] tables"),
        ("[tenants.a\n", "Expected ']'"),
    ],
)
def test_a_file_that_cannot_be_used_is_refused_naming_the_field(text, message, tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(TenantsError, match=re.escape(message)) as info:
        Tenants.read(path)
    assert str(path) in str(info.value)


def test_keys_are_hashes_and_one_file_or_one_key(tmp_path):
    path = write_tenants(tmp_path / "keys.toml", {"alice": {"max_in_flight": 4, "priority": [0, 5]}, "bob": {}})
    tenants = Tenants.read(path)
    assert tenants.who(b"alice-key") == "alice" and tenants.who(b"bob-key") == "bob"
    assert tenants.who(b"alice-key ") is None and tenants.who(sha("alice-key").encode()) is None
    assert tenants.tenants["alice"].max_in_flight == 4 and tenants.tenants["alice"].priority == (0, 5)
    from diffusiond.daemon.auth import check_exposure

    with pytest.raises(ConfigError, match="--api-key and --api-keys-file: give one"):
        check_exposure(ServeConfig(api_key="k", api_keys_file=str(path)))
    check_exposure(ServeConfig(host="0.0.0.0", api_keys_file=str(path)))  # keys: it may listen beyond loopback
    with pytest.raises(ConfigError, match=r"--api-keys-file .*missing\.toml"):
        check_exposure(ServeConfig(api_keys_file=str(tmp_path / "missing.toml")))


# ---- images and generations ----


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    tenants = {"alice": {"max_in_flight": 1}, "bob": {"admin": True}}
    return write_tenants(tmp_path_factory.mktemp("tenants") / "keys.toml", tenants)


@pytest.fixture(scope="module")
def tenants_server(serve, keys_file):
    return serve(api_keys_file=str(keys_file))


def test_the_shared_lora_adapters_and_metrics_are_the_admin_s(tenants_server):
    """Every tenant's requests may name the shared adapters: registering or deleting one is an admin tenant's (bob),
    403 for another (alice; before, any tenant could delete another's adapters). /metrics: 401 without a key."""
    base = tenants_server.base_url

    def call(method: str, path: str, name: str | None, body: dict | None = None) -> int:
        headers = {**(auth(name) if name else {}), "Content-Type": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        try:
            with urllib.request.urlopen(
                urllib.request.Request(f"{base}{path}", data=data, method=method, headers=headers), timeout=10
            ) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    adapter = {"name": "ink", "path": "/nonexistent/ink.safetensors"}
    assert call("POST", "/v1/loras", "alice", adapter) == 403
    assert call("DELETE", "/v1/loras/ink", "alice") == 403
    assert call("POST", "/v1/loras", "bob", adapter) in (400, 404)  # past the check: the file is not there
    assert call("DELETE", "/v1/loras/ink", "bob") == 404
    assert call("GET", "/v1/loras", "alice") == 200  # listing them is anyone's
    assert (call("GET", "/metrics", None), call("GET", "/metrics", "alice"), call("GET", "/metrics", "bob")) == (
        401, 403, 200
    )  # fmt: skip


async def first_event(resp: aiohttp.ClientResponse) -> str:
    async for line in resp.content:
        if line.startswith(b"event:"):
            return line.split(b":", 1)[1].strip().decode()
    raise AssertionError("the stream ended without an event")


@pytest.mark.asyncio
async def test_a_tenant_sees_and_cancels_only_its_own_requests(tenants_server, keys_file):
    base = tenants_server.base_url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{base}/v1/generations", json=LONG, headers=auth("alice")) as stream:
            assert stream.status == 200, await stream.text()
            rid = stream.headers["X-Request-Id"]
            assert await first_event(stream) in ("queued", "progress")
            # bob: alice's request is unknown, to read and to cancel.
            for method, path in (("GET", rid), ("DELETE", rid), ("GET", f"{rid}/events")):
                async with session.request(method, f"{base}/v1/generations/{path}", headers=auth("bob")) as resp:
                    assert resp.status == 404, (method, path, await resp.text())
                    assert (await resp.json())["error"]["code"] == "not_found"
            async with session.get(f"{base}/v1/generations/{rid}", headers=auth("alice")) as resp:
                assert resp.status == 200 and (await resp.json())["owner"] == "alice"
            # alice's quota: one in flight; a second is refused with the quota named. bob's are not hers.
            async with session.post(f"{base}/v1/images/generations", json=IMAGE, headers=auth("alice")) as resp:
                assert resp.status == 429, await resp.text()
                error = (await resp.json())["error"]
                assert error["code"] == "max_in_flight" and "tenant alice: quota max_in_flight" in error["message"]
                assert error["type"] == "rate_limit_error" and resp.headers["Retry-After"]
            async with session.post(f"{base}/v1/images/generations", json=IMAGE, headers=auth("bob")) as resp:
                assert resp.status == 200, await resp.text()

            # A reload revokes bob and adds carol; alice's request runs on.
            write_tenants(keys_file, {"alice": {"max_in_flight": 1}, "carol": {"admin": True}})
            tenants_server.loop.call_soon_threadsafe(reload_tenants, tenants_server.app)
            deadline = time.monotonic() + 10
            while True:
                async with session.get(f"{base}/v1/models", headers=auth("carol")) as resp:
                    if resp.status == 200:
                        break
                assert time.monotonic() < deadline, "carol's key was never accepted"
                await asyncio.sleep(0.05)
            async with session.get(f"{base}/v1/models", headers=auth("bob")) as resp:
                assert resp.status == 401
            async with session.get(f"{base}/v1/generations/{rid}", headers=auth("alice")) as resp:
                assert (await resp.json())["status"] in ("queued", "running")
            async with session.delete(f"{base}/v1/generations/{rid}", headers=auth("alice")) as resp:
                assert resp.status == 202, await resp.text()
            events = [line async for line in stream.content if line.startswith(b"event:")]
            assert events[-1].split(b":", 1)[1].strip() == b"cancelled", events[-3:]
        # /metrics names every tenant: an admin tenant's alone (carol's, added by the reload).
        for headers, status in (({}, 401), (auth("alice"), 403)):
            async with session.get(f"{base}/metrics", headers=headers) as resp:
                assert resp.status == status, await resp.text()
        async with session.get(f"{base}/metrics", headers=auth("carol")) as resp:
            metrics = samples(await resp.text())
    assert metrics['diffusiond_tenant_quota_refusals_total{quota="max_in_flight",tenant="alice"}'] == 1
    assert metrics['diffusiond_tenant_requests_total{outcome="completed",tenant="bob"}'] >= 1
    assert metrics['diffusiond_tenant_requests_total{outcome="cancelled",tenant="alice"}'] == 1
    assert metrics['diffusiond_tenant_requests_in_flight{tenant="alice"}'] == 0
    assert 'diffusiond_tenant_requests_in_flight{tenant="carol"}' in metrics  # added by the reload


# ---- videos ----


@pytest.fixture(scope="module")
def video_tenants_server(serve, tiny_wan, tmp_path_factory):
    keys = tmp_path_factory.mktemp("video-tenants") / "keys.toml"
    write_tenants(keys, {"alice": {"max_stored_jobs": 1}, "bob": {}, "carol": {"max_stored_bytes": 2000}})
    return serve(model=tiny_wan, api_keys_file=str(keys), max_pixels=64 * 64)


@pytest.mark.asyncio
async def test_a_tenant_sees_only_its_own_videos(video_tenants_server):
    base = video_tenants_server.base_url
    clip = {"prompt": "a cat", "size": "64x64", "num_frames": 5, "num_inference_steps": 1, "seed": 1}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{base}/v1/videos", json=clip, headers=auth("alice")) as resp:
            assert resp.status == 200, await resp.text()
            job = await resp.json()
        deadline = time.monotonic() + 60
        while True:
            async with session.get(f"{base}/v1/videos/{job['id']}", headers=auth("alice")) as resp:
                assert resp.status == 200
                if (await resp.json())["status"] == "completed":
                    break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        # bob: not in his list, and unknown to every route that names it.
        async with session.get(f"{base}/v1/videos", headers=auth("bob")) as resp:
            assert resp.status == 200 and (await resp.json())["data"] == []
        for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            async with session.request(method, f"{base}/v1/videos/{job['id']}{path}", headers=auth("bob")) as resp:
                assert resp.status == 404, (method, path, await resp.text())
        async with session.get(f"{base}/v1/videos", headers=auth("alice")) as resp:
            assert [j["id"] for j in (await resp.json())["data"]] == [job["id"]]
        async with session.get(f"{base}/v1/videos/{job['id']}/content", headers=auth("alice")) as resp:
            assert resp.status == 200 and len(await resp.read()) > 0

        # alice keeps one job: a new one forgets her finished one; while that one runs, a third is refused.
        running = {**clip, "num_inference_steps": 1000}
        async with session.post(f"{base}/v1/videos", json=running, headers=auth("alice")) as resp:
            assert resp.status == 200, await resp.text()
            second = await resp.json()
        async with session.get(f"{base}/v1/videos/{job['id']}", headers=auth("alice")) as resp:
            assert resp.status == 404
        async with session.post(f"{base}/v1/videos", json=clip, headers=auth("alice")) as resp:
            assert resp.status == 429, await resp.text()
            assert (await resp.json())["error"]["code"] == "max_stored_jobs"
        async with session.post(f"{base}/v1/videos", json=clip, headers=auth("bob")) as resp:
            assert resp.status == 200, await resp.text()  # bob's share is his own
        async with session.delete(f"{base}/v1/videos/{second['id']}", headers=auth("alice")) as resp:
            assert resp.status == 200


@pytest.mark.asyncio
async def test_clips_kept_by_url_count_against_the_tenant_s_stored_bytes(video_tenants_server):
    """A native stream's clip kept by URL (daemon/files.py) is charged to its tenant's max_stored_bytes, as its videos
    are (they share it): carol's 2000 bytes take no 64x64 clip (429 naming the quota: the answer says why), bob's
    unbounded share takes it. Without the quota passed to the file store, carol's clip was kept (red)."""
    base = video_tenants_server.base_url
    clip = {"prompt": "a cat", "width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 1, "seed": 1,
            "response_format": "url", "video_format": "webp"}  # fmt: skip
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for name in ("carol", "bob"):
            async with session.post(f"{base}/v1/generations", json=clip, headers=auth(name)) as resp:
                text = await resp.text()
            assert resp.status == 200, text
            last = [line for line in text.splitlines() if line.startswith("data: ")][-1]
            event = json.loads(last.removeprefix("data: "))
            if name == "carol":
                assert event["type"] == "failed" and "quota max_stored_bytes" in event["error"], event
            else:
                assert event["type"] == "completed" and event["video"]["url"], event


# ---- SIGHUP ----


def test_sighup_reads_the_file_again_under_the_launcher(tiny_sd3, tmp_path):
    """Two ranks: SIGHUP to the launcher reaches rank 0, which reads the file again; the group is not restarted
    (the elastic agent would stop every worker on a SIGHUP of its own)."""
    keys = write_tenants(tmp_path / "keys.toml", {"alice": {}})
    port = free_port()
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", tiny_sd3, "--port", str(port), "--nproc", "2",
           "--cfg-parallel", "2", "--api-keys-file", str(keys)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    env.update(OMP_NUM_THREADS="1", DIFFUSIOND_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        assert status_as(f"{base}/v1/models", "alice") == 200
        assert status_as(f"{base}/v1/models", "carol") == 401
        write_tenants(keys, {"carol": {}})
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while status_as(f"{base}/v1/models", "carol") != 200:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            time.sleep(0.1)
        assert status_as(f"{base}/v1/models", "alice") == 401
        text = (tmp_path / "daemon.log").read_text()
        assert "SIGHUP: 1 tenants (added: carol; removed: alice)" in text
        assert "restart" not in text.lower().replace("max restarts", ""), text[-3000:]
    finally:
        kill_tree(proc)
        log.close()


def test_queued_and_in_flight_quotas_count_the_tenant_s_own_requests():
    from diffusiond.daemon.admission import check_quotas
    from diffusiond.daemon.state import Record, ServerState
    from diffusiond.daemon.tenants import Tenant

    state = ServerState(ServeConfig())
    for i, (owner, status) in enumerate([("alice", "queued"), ("alice", "running"), ("alice", "completed"),
                                         ("bob", "queued"), ("bob", "queued")]):  # fmt: skip
        state.records[str(i)] = Record(str(i), 0, status=status, owner=owner)
    alice = Tenant(name="alice", key_sha256=sha("a"), max_in_flight=5, max_queued=2)
    check_quotas(state, alice, 1)  # 2 in flight (1 waiting) + 1
    with pytest.raises(Exception, match=r"quota max_queued reached \(1 of 2 used, 2 more asked\)") as info:
        check_quotas(state, alice, 2)
    assert info.value.status == 429 and info.value.code == "max_queued"
    with pytest.raises(Exception, match="quota max_in_flight") as info:
        check_quotas(state, Tenant(name="alice", key_sha256=sha("a"), max_in_flight=2), 1)
    check_quotas(state, Tenant(name="carol", key_sha256=sha("c"), max_in_flight=1, max_queued=1), 1)


def test_a_record_in_flight_is_never_dropped(monkeypatch):
    """Records are bounded (MAX_RECORDS): the oldest finished go. Dropping the oldest whatever it was forgot a long
    request still running: its tenant's quota stopped counting it and its owner could no longer see or cancel it
    (red before)."""
    from types import SimpleNamespace

    from diffusiond.daemon import state as state_module
    from diffusiond.engine.outputs import Completed

    monkeypatch.setattr(state_module, "MAX_RECORDS", 4)
    state = state_module.ServerState(ServeConfig())

    def handle(rid: str):
        return SimpleNamespace(request_id=rid, params=SimpleNamespace(steps_to_run=10))

    state.record(handle("long"), "alice")  # still running at the end
    for n in range(10):
        state.record(handle(f"short{n}"), "bob")
        state._on_event(Completed(f"short{n}", image=None, seed=0))
    assert state.owned("long", "alice") is not None and state.usage("alice") == (1, 1)
    assert len(state.records) == 4 and list(state.records)[1:] == ["short7", "short8", "short9"]
