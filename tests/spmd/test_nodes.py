"""Several nodes on loopback: two elastic agents (`diffusiond serve --nnodes 2 --nproc 1`, torchrun's agent and
c10d rendezvous) form one CFG-parallel group, exactly as README's multi-node commands start it.

One story, in order: the group serves; node 1's worker dies (its request fails with one terminal event, clients
that connect during the heal are served after it); node 1's agent dies (its worker leaves too, no orphan); node 1
comes back (the group heals without anyone touching node 0); SIGTERM on both nodes drains and both exit 0. The
times to heal are printed (`-s`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import (
    Client,
    alive,
    free_port,
    kill_tree,
    rank_pid,
    stream,
    terminal_events,
    wait_not_ready,
    wait_ready,
)

pytestmark = pytest.mark.slow


class Nodes:
    def __init__(self, model: str, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.port, self.rdzv = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
        self.env = {**env, "OMP_NUM_THREADS": "1", "DIFFUSIOND_CACHE": str(tmp / "cache")}

    def start(self, node: int) -> subprocess.Popen:
        # README's command; on one machine both nodes name the same HTTP port: only global rank 0 binds it.
        cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", self.model, "--port", str(self.port)]
        cmd += ["--nnodes", "2", "--nproc", "1", "--cfg-parallel", "2", "--rdzv-endpoint", f"127.0.0.1:{self.rdzv}"]
        cmd += ["--rdzv-timeout", "120", "--max-restarts", "10", "--drain-timeout", "5", "--max-steps", "1000"]
        log = open(self.tmp / f"node{node}.log", "a")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def wait_rendezvous_store(self, proc: subprocess.Popen) -> None:
        """Node 0's agent hosts the rendezvous store (the first agent at the endpoint does); start node 1 after it,
        so that killing node 1 never takes the store down."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, self.logs()
            try:
                socket.create_connection(("127.0.0.1", self.rdzv), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("no rendezvous store")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.tmp.glob("node*.log")))


@pytest.fixture
def nodes(tiny_sd3, tmp_path):
    nodes = Nodes(tiny_sd3, tmp_path)
    try:
        yield nodes
    finally:
        for proc in nodes.procs:
            kill_tree(proc)


def body(prompt: str, steps: int, seed: int) -> dict:
    return {
        "prompt": prompt,
        "width": 64,
        "height": 64,
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
        "seed": seed,
    }


def completes(base: str, prompt: str, seed: int) -> None:
    events = list(stream(base, body(prompt, 3, seed)))
    assert events[-1][0] == "completed", events[-1]


def gone_within(pids: list[int], seconds: float) -> float:
    t0 = time.monotonic()
    while any(alive(pid) for pid in pids) and time.monotonic() - t0 < seconds:
        time.sleep(0.1)
    return time.monotonic() - t0


def test_two_nodes_serve_heal_and_drain(nodes):
    node0 = nodes.start(0)
    nodes.wait_rendezvous_store(node0)
    node1 = nodes.start(1)
    print(f"\ntwo nodes ready after {wait_ready(nodes.base, node0, node1):.1f} s")
    # Rank 0 (HTTP) runs on node 0: the rendezvous orders nodes by address, then agent pid, and node 0 started first.
    rank0, rank1 = rank_pid(node0.pid, 0), rank_pid(node1.pid, 1)
    assert rank0 and rank1, nodes.logs()
    completes(nodes.base, "a red circle", 1)

    # 1. Node 1's worker dies with a request in flight: one terminal event (failed), then the group heals.
    client = Client(nodes.base, body("a long one", 1000, 2))
    client.start()
    assert client.progress.wait(60), nodes.logs()
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    client.join(30)
    assert client.error is None and terminal_events(client.names) == ["failed"], (client.names[-3:], nodes.logs())
    assert client.names[-1] == "failed"
    print(f"node 1's worker killed: its request failed after {client.ended_at - t0:.2f} s")
    wait_not_ready(nodes.base)
    # Clients that connect during the heal wait in the backlog of the socket node 0's launcher holds, and the next
    # rank 0 serves them at their first attempt (before: rank 0's own socket closed with it, connection refused).
    during = [Client(nodes.base, body("during the heal", 3, 10 + i)) for i in range(5)]
    for c in during:
        c.start()
    for c in during:
        c.join(120)
    assert [(c.error, terminal_events(c.names)) for c in during] == [(None, ["completed"])] * 5, nodes.logs()
    wait_ready(nodes.base, node0, node1)
    print(f"node 1's worker killed: ready again after {time.monotonic() - t0:.1f} s")
    rank0, rank1 = rank_pid(node0.pid, 0), rank_pid(node1.pid, 1)
    assert rank0 and rank1, nodes.logs()
    completes(nodes.base, "after a worker fault", 3)

    # 2. Node 1's agent dies (SIGKILL: no chance to stop its worker). The worker must not live on as an orphan.
    client = Client(nodes.base, body("another long one", 1000, 4))
    client.start()
    assert client.progress.wait(60), nodes.logs()
    node1.kill()
    node1.wait(10)
    t0 = time.monotonic()
    orphan_for = gone_within([rank1], 10)
    assert not alive(rank1), f"node 1's worker outlived its agent\n{nodes.logs()}"
    print(f"node 1's agent killed: its worker exited after {orphan_for:.1f} s")
    client.join(30)
    assert client.error is None and terminal_events(client.names) == ["failed"], (client.names[-3:], nodes.logs())
    wait_not_ready(nodes.base)
    assert node0.poll() is None, "node 0 must wait for node 1, not give up"

    # 3. Node 1 comes back: the group forms again without anyone touching node 0.
    time.sleep(2)
    t0 = time.monotonic()
    node1 = nodes.start(1)
    print(f"node 1 relaunched: ready again after {wait_ready(nodes.base, node0, node1):.1f} s")
    rank0, rank1 = rank_pid(node0.pid, 0), rank_pid(node1.pid, 1)
    assert rank0 and rank1, nodes.logs()
    completes(nodes.base, "after a lost node", 5)

    # 4. SIGTERM on every node: the request in flight finishes within the drain, every process exits 0.
    client = Client(nodes.base, body("drained", 40, 6))
    client.start()
    assert client.progress.wait(60), nodes.logs()
    t0 = time.monotonic()
    for proc in (node1, node0):
        os.kill(proc.pid, signal.SIGTERM)
    codes = [proc.wait(40) for proc in (node0, node1)]
    print(f"SIGTERM on both nodes: exit codes {codes} after {time.monotonic() - t0:.1f} s")
    client.join(10)
    assert codes == [0, 0], nodes.logs()
    assert terminal_events(client.names) == ["completed"], client.names[-3:]
    assert gone_within([rank0, rank1], 5) < 5
