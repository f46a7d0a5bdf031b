"""Two diffusiond replicas behind HAProxy (Debian's `haproxy`) with `deploy/haproxy/haproxy.cfg` as shipped, for
the tests in tests/deploy.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from balancer import ...`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from procs import free_port, wait_ready

HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
CONFIG = Path(__file__).parents[1] / "deploy" / "haproxy" / "haproxy.cfg"
# HAProxy's httplog: ... frontend backend/server Tq/Tw/Tc/Tr/Ta status bytes - - TERM ...
LOG_LINE = re.compile(r' replicas/(\S+) \S+ (\d{3}) \d+ \S+ \S+ (\S{4}) .* "POST /v1/generations ')


class Replicas:
    def __init__(self, model: str, tmp: Path, args: list[str] | None = None) -> None:
        self.model, self.tmp = model, tmp
        # Flags of both replicas; "{i}" in one becomes the replica's number (1, 2).
        self.args = args or []
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
        cmd += [a.replace("{i}", str(i + 1)) for a in self.args]
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


@contextlib.contextmanager
def running(replicas: Replicas) -> Iterator[Replicas]:
    """Both replicas ready and in HAProxy's pool; everything stopped at the end."""
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
