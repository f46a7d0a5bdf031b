"""Prometheus' text exposition in tests: its samples by name, and the Prometheus tools CI installs.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from exposition import ...`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from needs import missing


def need(tool: str) -> str:
    """CI installs Debian's prometheus package (.ci/run); on a developer machine without it, skip."""
    path = shutil.which(tool)
    if path is None:
        missing(f"needs {tool} (apt-get install prometheus; .ci/run installs it)")
    return path


def samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@contextlib.contextmanager
def prometheus_scraping(target: str, folder: Path) -> Iterator[Callable[[str], list[dict]]]:
    """A real Prometheus (Debian's) scraping `target` (host:port) every second as job "diffusiond"; yields
    `query(promql) -> result` (an instant query now; AssertionError naming the query when it does not parse)."""
    prometheus = need("prometheus")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: diffusiond\n    static_configs:\n      - targets: ['{target}']\n"
    )
    argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}"]
    argv.append(f"--web.listen-address=127.0.0.1:{port}")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400: the query does not parse
            raise AssertionError(f"{promql}: {exc.read().decode()}") from None
        assert body["status"] == "success", (promql, body)
        return body["data"]["result"]

    try:
        deadline = time.monotonic() + 30
        while True:  # up: it answers queries
            try:
                query("up")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        yield query
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
