"""Two replicas behind HAProxy (Debian's `haproxy`), with `deploy/haproxy/haproxy.cfg` as shipped, loaded by
`diffusiond bench serve` through the balancer.

- A replica drained with SIGTERM (`--unready-delay 2`) loses nothing: it leaves the pool before it refuses anything.
- A replica killed with SIGKILL fails exactly the requests it held (HAProxy's log says which: those it had sent to
  that replica and lost to the server side), each with a clean error and none hanging; the rest complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import free_port, get, wait_ready

pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
CONFIG = Path(__file__).parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
# HAProxy's httplog: ... frontend backend/server Tq/Tw/Tc/Tr/Ta status bytes - - TERM ...
LOG_LINE = re.compile(r' replicas/(\S+) \S+ (\d{3}) \d+ \S+ \S+ (\S{4}) .* "POST /v1/generations ')


class Replicas:
    def __init__(self, model: str, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.ports = [free_port(), free_port()]
        self.procs: dict[int, subprocess.Popen] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
        # Two replicas and the load generator on 2 cores: one torch thread each.
        self.env = {**env, "OMP_NUM_THREADS": "1", "DIFFUSIOND_CACHE": str(tmp / "cache")}
        self.lb_port = free_port()
        self.lb: subprocess.Popen | None = None

    def base(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    @property
    def lb_url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    def start(self, i: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", self.model, "--port", str(self.ports[i])]
        cmd += ["--unready-delay", "2", "--drain-timeout", "30"]
        with open(self.tmp / f"replica{i + 1}.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[i] = proc
        return proc

    def start_balancer(self) -> None:
        env = {
            **self.env,
            "DIFFUSIOND_LISTEN": f"127.0.0.1:{self.lb_port}",
            "DIFFUSIOND_REPLICA1": f"127.0.0.1:{self.ports[0]}",
            "DIFFUSIOND_REPLICA2": f"127.0.0.1:{self.ports[1]}",
            "DIFFUSIOND_HAPROXY_STATS": str(self.tmp / "haproxy.sock"),
        }
        with open(self.tmp / "haproxy.log", "w") as log:
            self.lb = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(CONFIG)], stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_in_pool(self, i: int, within: float = 20.0) -> None:
        """Until HAProxy routes to replica i: its health checks show up in the replica's access log as /ready 200."""
        log = self.tmp / f"replica{i + 1}.log"
        checks = re.compile(r'"GET /ready HTTP/1\.\d" 200')
        start = len(checks.findall(log.read_text()))
        deadline = time.monotonic() + within
        # `rise 2`: two passing checks bring a server up.
        while len(checks.findall(log.read_text())) < start + 3:
            assert time.monotonic() < deadline, f"replica {i + 1} never checked healthy"
            time.sleep(0.2)

    def stats(self) -> dict[str, dict[str, int]]:
        """HAProxy's own counters per replica (its stats socket): stot (requests sent), srv_abrt (transfers the
        replica aborted), eresp (response errors), scur (its sessions open to the replica now). Counters, unlike
        log lines, are never dropped."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.tmp / "haproxy.sock"))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        out = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("pxname") == "replicas" and row.get("svname", "").startswith("replica"):
                out[row["svname"]] = {k: int(row[k] or 0) for k in ("stot", "srv_abrt", "eresp", "scur")}
        return out

    def balancer_log(self) -> list[tuple[str, int, str]]:
        """(server, status, termination state) of the generation requests HAProxy logged, one line per request
        (its log goes to a file here, which does not block, so no line is dropped for a full pipe)."""
        text = (self.tmp / "haproxy.log").read_text()
        return [(m[1], int(m[2]), m[3]) for m in LOG_LINE.finditer(text)]

    def stop(self) -> None:
        for proc in [*self.procs.values(), self.lb]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def replicas(tiny_sd3, tmp_path):
    if HAPROXY is None:
        pytest.skip("needs Debian's haproxy (.ci/run installs it)")
    replicas = Replicas(tiny_sd3, tmp_path)
    try:
        for i in (0, 1):
            replicas.start(i)
        for i in (0, 1):
            wait_ready(replicas.base(i), replicas.procs[i])
        replicas.start_balancer()
        for i in (0, 1):
            replicas.wait_in_pool(i)
        yield replicas
    finally:
        replicas.stop()


CONCURRENCY = 6


def bench(replicas: Replicas, out: Path, requests: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diffusiond", "bench", "serve", "--base-url", replicas.lb_url, "--api", "native"]
    cmd += ["--num-requests", str(requests), "--concurrency", str(CONCURRENCY), "--size", "64x64", "--steps", "40"]
    cmd += ["--guidance-scale", "4", "--timeout", "60", "--no-progress", "--json", str(out)]
    for i in (0, 1):  # queue wait from the replicas themselves, not from whichever answers behind the balancer
        cmd += ["--metrics-url", replicas.base(i)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=replicas.env, text=True)


def held(base: str) -> int:
    """Requests the replica holds: running plus waiting, from its /metrics."""
    text = get(f"{base}/metrics")[1].decode()
    return sum(int(float(m[1])) for m in re.finditer(r"^diffusiond_requests_(?:running|waiting) (\S+)$", text, re.M))


def wait_holding(base: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while held(base) < 2:
        assert time.monotonic() < deadline, "the replica never got requests"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, out: Path) -> dict:
    output, _ = proc.communicate(timeout=120)
    print(output)
    assert proc.returncode == 0, output
    return json.loads(out.read_text())


def test_drain_loses_nothing_and_a_kill_fails_only_what_it_held(replicas, tmp_path):
    # Drain: SIGTERM replica 1 while the load runs through the balancer.
    load = bench(replicas, tmp_path / "drain.json", 60)
    wait_holding(replicas.base(0))
    t0 = time.monotonic()
    replicas.procs[0].send_signal(signal.SIGTERM)
    code = replicas.procs[0].wait(60)
    drained_in = time.monotonic() - t0
    summary = finish(load, tmp_path / "drain.json")
    stats = replicas.stats()
    served = {name: counters["stot"] for name, counters in stats.items()}
    print(
        f"drain: replica 1 exited {code} after {drained_in:.1f} s; {summary['completed']} completed, "
        f"{summary['failed']} failed of {summary['requests']}; sent by HAProxy to {served} (with /metrics reads)"
    )
    assert code == 0
    assert summary["requests"] == 60 and summary["failed"] == 0 and summary["completed"] == 60, summary
    assert served["replica1"] >= 2 and served["replica2"] >= 2, "both replicas must have served"

    # Back to two replicas, then kill replica 2 with requests in flight.
    replicas.start(0)
    wait_ready(replicas.base(0), replicas.procs[0])
    replicas.wait_in_pool(0)
    before = replicas.stats()
    load = bench(replicas, tmp_path / "kill.json", 60)
    wait_holding(replicas.base(1))
    # What replica 2 holds: what its engine admitted, or, counting requests still on their way in (sent by the
    # balancer, not yet parsed and queued), the balancer's sessions open to it; whichever is more.
    held_at_kill = max(held(replicas.base(1)), replicas.stats()["replica2"]["scur"])
    replicas.procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    summary = finish(load, tmp_path / "kill.json")
    after = replicas.stats()
    # Requests HAProxy had handed to replica 2 and lost on the server side: logged with a termination state that
    # blames the server (S...), one line per request. Its response-error counter (eresp) rises at least as much:
    # it counted a 502 twice in one run (3 cut streams + 2 502s = 7), so it bounds the count rather than gives it.
    lost = sum(server == "replica2" and state[0] == "S" for server, _, state in replicas.balancer_log())
    errors = after["replica2"]["eresp"] - before["replica2"]["eresp"]
    print(
        f"kill: replica 2 held {held_at_kill} at the kill; {summary['completed']} completed, {summary['failed']} "
        f"failed of {summary['requests']} ({summary['errors']}); HAProxy: {lost} lost on replica 2 (log), "
        f"{errors} response errors (counters); load finished {time.monotonic() - t0:.1f} s after the kill"
    )
    assert summary["requests"] == 60 and summary["completed"] + summary["failed"] == 60, summary
    assert summary["failed"] == lost >= 1, (summary, lost)
    assert errors >= lost, (after, before)
    # At most what was in flight: the sample of what replica 2 held is taken just before the kill, and requests
    # sent to it in between also fail (CI saw 6 fail with 3 sampled, each blamed on replica 2 by the log above); the
    # load never has more than its concurrency in flight.
    assert summary["failed"] <= CONCURRENCY, (summary, held_at_kill)
    # Clean errors: cut streams (SSE without a terminal event) or 502s from the balancer, no timeouts.
    assert not any("Timeout" in kind for kind in summary["errors"]), summary["errors"]
    assert not summary["refused"], summary["refused"]
