"""The Grafana dashboard (issue 34): built in code with grafana-foundation-sdk (tools/dashboard.py), shipped as its
output, and every panel's query run against a real Prometheus that scraped a live daemon under load: each parses
and returns series. The load makes every panel's series exist: classes 0 and 9 on one slot (a pause), a seeded
request sent twice (a result cache hit), streams with previews, the OpenAI route.
Broken on purpose once: a panel querying `diffusiond_preemption_total` (a name the daemon does not export) went red
naming it."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exposition import prometheus_scraping

from diffusiond.tools.dashboard import render

DASHBOARD = Path(__file__).parents[2] / "metrics" / "grafana-dashboard.json"
# What Grafana substitutes before a query leaves it.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": "diffusiond"}


def test_the_shipped_dashboard_is_the_sdk_build():
    """metrics/grafana-dashboard.json is `python -m diffusiond.tools.dashboard`'s output, unedited."""
    assert DASHBOARD.read_text() == render(), "run: python -m diffusiond.tools.dashboard"
    dashboard = json.loads(DASHBOARD.read_text())
    # Importable as is: a Prometheus data source variable, no data source uid of anyone's Grafana.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "latency", "queue", "batch", "stage", "preview", "lag", "class", "tenant"):
        assert topic in titles, topic
    for topic in ("preemption", "result cache"):
        assert topic in titles, topic


def post(base: str, route: str, body: dict, lines: bool = False) -> Any:
    """The answer's body; `lines`: its lines as they arrive."""
    req = urllib.request.Request(
        base + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    if lines:
        return streamed(req)
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return resp.read()


def streamed(req: urllib.request.Request) -> Iterator[bytes]:
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        yield from resp


def load(base: str) -> None:
    """One slot: a long class-0 stream, then a class-9 request pauses it; a seeded request twice; the OpenAI route."""
    low = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 200, "seed": 1}
    stepping = threading.Event()

    def background() -> None:
        for line in post(base, "/v1/generations", {**low, "preview_every": 10}, lines=True):
            if line.startswith(b"event: progress"):
                stepping.set()

    thread = threading.Thread(target=background)
    thread.start()
    # The class-9 request goes once the class-0 one steps (a second's sleep was once longer than its 120 steps).
    assert stepping.wait(60), "the class-0 stream never made progress"
    post(base, "/v1/generations", {**low, "num_inference_steps": 2, "priority": 9, "seed": 2})
    thread.join()
    seeded = {"prompt": "a blue square", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 3}
    post(base, "/v1/generations", seeded)
    assert b'"cached":true' in post(base, "/v1/generations", seeded).replace(b" ", b"")
    post(base, "/v1/images/generations", {"prompt": "a green disc", "size": "64x64", "num_inference_steps": 2})


def test_every_panel_query_returns_series_from_a_live_daemon(serve, tmp_path):
    server = serve(max_batch=1, result_cache_bytes=1 << 20, priority_aging_steps=10_000)
    server.wait_idle()
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries[f"{panel['title']} [{target['refId']}]"] = expr
    assert len(queries) >= 20
    with prometheus_scraping(urllib.parse.urlparse(server.base_url).netloc, tmp_path) as query:
        time.sleep(2)  # a scrape before the load: rates start from it
        load(server.base_url)
        empty = dict(queries)
        deadline = time.monotonic() + 60
        while empty and time.monotonic() < deadline:
            empty = {name: expr for name, expr in empty.items() if not query(expr)}
            time.sleep(1)
    assert not empty, f"panels whose queries return no series: {empty}"
