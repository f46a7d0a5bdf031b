"""Helpers for tests that run the daemon as real processes (SPMD ranks, several nodes, replicas behind a balancer).

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from procs import ...`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from diffusiond.daemon.launch import free_port

__all__ = ["free_port"]

READY_WITHIN = 120.0
TERMINAL = ("completed", "cancelled", "failed")


def children(pid: int) -> list[int]:
    """All descendants of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        out += kids
        frontier += kids
    return out


def rss(pid: int | str = "self") -> int:
    """Resident memory of a process (this one by default), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """The agent starts workers in sessions of their own: killing the launcher's group would leave them running."""
    for pid in [proc.pid, *children(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)


def rank_pid(launcher: int, rank: int) -> int | None:
    """The worker of global rank `rank` among the launcher's descendants."""
    for pid in children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"_DIFFUSIOND_RANK_CONFIG=") for e in env):
            return pid
    return None


def get(url: str | urllib.request.Request, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET, or of any request given as a Request; an HTTP error's too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def ready(base: str) -> bool:
    try:
        return get(f"{base}/ready", timeout=2.0)[0] == 200
    except OSError:
        return False


def wait_ready(base: str, *procs: subprocess.Popen, within: float = READY_WITHIN) -> float:
    """Seconds until /ready answers 200; fails at once if one of `procs` exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[:6]} exited with {proc.returncode}"
        if ready(base):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"not ready within {within}s")


def wait_not_ready(base: str, within: float = 30.0) -> float:
    t0 = time.monotonic()
    while ready(base):
        assert time.monotonic() - t0 < within, f"still ready after {within}s"
        time.sleep(0.1)
    return time.monotonic() - t0


def stream(base: str, body: dict, timeout: float = 60.0, headers: dict[str, str] | None = None):
    """Native SSE events as (name, data) pairs."""
    req = urllib.request.Request(
        f"{base}/v1/generations",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        name = None
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield name, json.loads(line[6:])


def terminal_events(names: list[str]) -> list[str]:
    return [n for n in names if n in TERMINAL]


class Client(threading.Thread):
    """One native stream read in the background: event names, the last event's data, when it ended."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, body
        self.names: list[str] = []
        self.last: dict = {}
        self.error: BaseException | None = None
        self.progress = threading.Event()
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            for name, data in stream(self.base, self.body, timeout=120):
                self.names.append(name)
                self.last = data
                if name == "progress" and data["step"] >= 2:
                    self.progress.set()
        except Exception as exc:  # reported by the test through `error`
            self.error = exc
        finally:
            self.ended_at = time.monotonic()


def refused(*args: str) -> str:
    """Runs `diffusiond ARGS` and asserts it refused: exit code 2, a message rather than a traceback. Its stderr."""
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "diffusiond", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr
