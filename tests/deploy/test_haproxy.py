"""Two replicas behind HAProxy (Debian's `haproxy`), with `deploy/haproxy/haproxy.cfg` as shipped, loaded by
`diffusiond bench serve` through the balancer.

- A replica drained with SIGTERM (`--unready-delay 2`) loses nothing: it leaves the pool before it refuses anything.
- A replica killed with SIGKILL fails exactly the requests it held (HAProxy's log says which: those it had sent to
  that replica and lost to the server side), each with a clean error and none hanging; the rest complete.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from balancer import HAPROXY, Replicas, running
from needs import missing
from procs import get, wait_ready

pytestmark = pytest.mark.slow


@pytest.fixture
def replicas(tiny_sd3, tmp_path):
    if HAPROXY is None:
        missing("needs Debian's haproxy (.ci/run installs it)")
    replicas = Replicas(tiny_sd3, tmp_path)
    with running(replicas):
        yield replicas


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
