"""`diffusiond serve` as a real subprocess: service manager notifications (READY, WATCHDOG, STATUS, STOPPING), the
drain on SIGTERM (running requests finish, new ones get 503, the rest are cancelled at the deadline, exit 0), and a
second signal that exits at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from sse import sse_events

# Long enough to still be running at any drain deadline here (max steps: 1000, ~10 ms or more each).
LONG_STEPS = 1000
# Short enough to finish well inside the drain deadline below.
SHORT_STEPS = 10
DRAIN_TIMEOUT_S = 3
TIMEOUT = aiohttp.ClientTimeout(total=120)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def native(steps: int, seed: int) -> dict:
    return {"prompt": "drain", "seed": seed, "width": 64, "height": 64, "num_inference_steps": steps}


class Stream:
    """A native SSE request held open: read up to its first progress event, then to its end."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: dict) -> None:
        self._cm = session.post(url, json=body)
        self.events: list[tuple[str, dict]] = []

    async def until_running(self) -> Stream:
        self.resp = await self._cm.__aenter__()
        assert self.resp.status == 200, await self.resp.text()
        self._iter = sse_events(self.resp)
        async for name, data in self._iter:
            self.events.append((name, data))
            if name == "progress":
                return self
        raise AssertionError(f"stream ended before any progress: {self.events}")

    async def rest(self) -> list[tuple[str, dict]]:
        async for name, data in self._iter:
            self.events.append((name, data))
        await self.close()
        return self.events

    async def close(self) -> None:
        await self._cm.__aexit__(None, None, None)


def test_notifies_ready_watchdog_status_and_stopping(start_daemon):
    daemon = start_daemon()
    daemon.wait_ready()
    # READY=1 comes after warm-up: by then the daemon is ready for traffic.
    status, body = get(f"{daemon.base_url}/ready")
    assert status == 200, body
    # Pings at half of WATCHDOG_USEC (0.2 s), from the event loop, while it serves.
    daemon.notify.wait_for("WATCHDOG=1", 30, count=5)

    daemon.signal(signal.SIGTERM)
    daemon.notify.wait_for("STOPPING=1", 30)
    assert daemon.wait_exit() == 0, daemon.log()

    lines = [line for line in daemon.notify.assignments() if line != "WATCHDOG=1"]
    statuses = [line.removeprefix("STATUS=") for line in lines if line.startswith("STATUS=")]
    assert statuses[0].startswith("loading"), lines
    assert any(s.startswith("ready") for s in statuses), lines
    assert any(s.startswith("draining") for s in statuses), lines
    # Loading, then READY, then STOPPING, each with its status line.
    assert lines.index("READY=1") < lines.index("STOPPING=1"), lines
    assert lines.index(f"STATUS={statuses[0]}") < lines.index("READY=1"), lines
    assert lines.count("READY=1") == 1, lines


@pytest.mark.asyncio
async def test_sigterm_drains_then_cancels_and_exits_0(start_daemon):
    daemon = start_daemon("--drain-timeout", str(DRAIN_TIMEOUT_S))
    await asyncio.to_thread(daemon.wait_ready)
    url = f"{daemon.base_url}/v1/generations"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        longs = [await Stream(session, url, native(LONG_STEPS, seed)).until_running() for seed in (1, 2)]
        short = await Stream(session, url, native(SHORT_STEPS, 3)).until_running()

        daemon.signal(signal.SIGTERM)
        await asyncio.to_thread(daemon.notify.wait_for, "STOPPING=1", 30)

        # Draining, with requests still running: not ready, and new requests are refused with the OpenAI error shape.
        status, body = await asyncio.to_thread(get, f"{daemon.base_url}/ready")
        assert (status, body["status"]) == (503, "draining"), body
        async with session.post(url, json=native(2, 4)) as resp:
            assert resp.status == 503, await resp.text()
            error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "unavailable", error
        openai_body = {"prompt": "drain", "size": "64x64", "num_inference_steps": 2}
        async with session.post(f"{daemon.base_url}/v1/images/generations", json=openai_body) as resp:
            assert resp.status == 503, await resp.text()

        # The short request finishes; the long ones are cancelled at the deadline, and their clients see it.
        short_events = await short.rest()
        assert short_events[-1][0] == "completed", short_events[-3:]
        for stream in longs:
            events = await stream.rest()
            assert events[-1][0] == "cancelled", events[-3:]
            assert events[-1][1]["type"] == "cancelled" and events[-1][1]["id"], events[-1]
            assert events[-2][0] == "progress" and events[-2][1]["step"] < LONG_STEPS, events[-3:]

    assert await asyncio.to_thread(daemon.wait_exit) == 0, daemon.log()
    assert "drain deadline passed: cancelling 2 requests" in daemon.log()
    # The last line says how the process ended.
    assert daemon.log().strip().splitlines()[-1].endswith("exiting with code 0"), daemon.log()[-500:]


@pytest.mark.asyncio
async def test_second_signal_exits_at_once(start_daemon):
    daemon = start_daemon("--drain-timeout", "600")
    await asyncio.to_thread(daemon.wait_ready)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        stream = await Stream(session, f"{daemon.base_url}/v1/generations", native(LONG_STEPS, 1)).until_running()
        daemon.signal(signal.SIGTERM)
        await asyncio.to_thread(daemon.notify.wait_for, "STOPPING=1", 30)
        # The drain would wait 600 s for the running request; a second signal does not.
        daemon.signal(signal.SIGINT)
        assert await asyncio.to_thread(daemon.wait_exit, 30) == 128 + signal.SIGINT, daemon.log()
        await stream.close()
    assert "SIGINT again: exiting now" in daemon.log()


def test_a_model_that_does_not_load_exits_1(start_daemon, tmp_path):
    """So that the service manager restarts it (Restart=on-failure), instead of a daemon that is never ready."""
    daemon = start_daemon("--model", str(tmp_path / "no-such-checkpoint"))
    assert daemon.wait_exit() == 1, daemon.log()
    lines = daemon.notify.assignments()
    assert "READY=1" not in lines
    assert any(line.startswith("STATUS=failed: model did not load") for line in lines), lines


def test_a_start_up_lora_that_does_not_fit_exits_2_naming_the_file(start_daemon, tiny_sd3, tmp_path):
    """A LoRA given with --lora whose shapes do not fit the model: one clear error line naming the file, no
    traceback, exit code 2 (a setting to fix, as a bad flag). Before: a traceback and exit code 1."""
    import torch
    from safetensors.torch import load_file, save_file

    from diffusiond.models.tiny.lora import build_tiny_lora

    good = build_tiny_lora(tiny_sd3, tmp_path / "good.safetensors", seed=1)
    tensors = load_file(str(good))
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.cat([tensors[key], tensors[key][:, :1]], dim=1)  # a column wider than its linear
    bad = tmp_path / "shapes.safetensors"
    save_file(tensors, str(bad))
    daemon = start_daemon("--lora", f"style={bad}")
    assert daemon.wait_exit() == 2, daemon.log()
    log = daemon.log()
    assert f"{bad}: does not fit this SD3Transformer2DModel" in log and "Traceback" not in log, log


def test_idle_connections_under_the_units_file_limit_starve_no_one(start_daemon):
    """The daemon under a soft and hard limit of 1024 open files (systemd's default soft limit, which it cannot raise
    here): it keeps its connections below the limit, so 1,200 idle ones cannot stop /health, /ready or a generation.
    Broken on purpose (no connection cap): /health could not connect (EMFILE on accept)."""
    daemon = start_daemon("--log-level", "WARNING", open_files=1024)
    daemon.wait_ready()
    idle = []
    try:
        for _ in range(1200):
            idle.append(socket.create_connection(("127.0.0.1", daemon.port), timeout=10))
        time.sleep(0.5)
        body = json.dumps({"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 2}).encode()
        for path, data in (("/health", None), ("/ready", None), ("/v1/generations", body)):
            t0 = time.monotonic()
            req = urllib.request.Request(
                f"{daemon.base_url}{path}", data=data, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read()
                assert resp.status == 200, text
            assert time.monotonic() - t0 < 2.0, path
        assert b"event: completed" in text
        fds = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
        assert fds < 1024, fds
        assert "serving at most" in daemon.log()  # it said why it serves fewer than --max-connections
    finally:
        for sock in idle:
            sock.close()


def test_systemd_socket_activation_serves_on_the_passed_socket(tiny_sd3, tmp_path):
    """As systemd passes `diffusiond.socket`: the listening socket as fd 3, LISTEN_FDS=1, LISTEN_PID the daemon's
    own pid. It serves there, and never binds --port (here a port another socket holds)."""
    import subprocess
    import sys

    passed = socket.socket()
    passed.bind(("127.0.0.1", 0))
    passed.listen(16)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = passed.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    argv = [sys.executable, "-m", "diffusiond", "serve", "--model", tiny_sd3, "--threads", "1"]
    argv += ["--port", str(taken.getsockname()[1])]
    script = 'exec 3<&"$1"; shift; LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"'
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            ["bash", "-c", script, "bash", str(passed.fileno()), *argv],
            pass_fds=[passed.fileno()],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    passed.close()  # the daemon holds it now
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if get(f"http://127.0.0.1:{port}/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(60)
        taken.close()
    assert proc.returncode == 0, (tmp_path / "daemon.log").read_text()
