"""/metrics on a live daemon: valid exposition (promtool), scraped by a real Prometheus, numbers that add up (the
dashboard's queries: tests/metrics/test_dashboard.py)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from exposition import need, prometheus_scraping, samples

from diffusiond.metrics.registry import STAGES


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def generate(server, steps: int, seed: int) -> None:
    body = json.dumps({"prompt": "a red circle", "size": "64x64", "num_inference_steps": steps, "seed": seed})
    req = urllib.request.Request(
        f"{server.base_url}/v1/images/generations",
        data=body.encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


@pytest.fixture
def live(server):
    server.wait_idle()
    return server


def test_promtool_finds_nothing(live):
    promtool = need("promtool")
    for seed in range(2):
        generate(live, steps=2, seed=seed)
    _, content_type, text = get(f"{live.base_url}/metrics")
    assert content_type.startswith("text/plain")
    assert "diffusiond_stage_seconds_bucket" in text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def test_openmetrics_on_request(live):
    _, content_type, text = get(f"{live.base_url}/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert content_type.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")


def test_counts_agree_with_requests_and_steps(live):
    k, s = 3, 4
    before = samples(get(f"{live.base_url}/metrics")[2])
    for seed in range(k):
        generate(live, steps=s, seed=seed)  # one after another: every forward holds exactly one request
    live.wait_idle()
    time.sleep(0.3)  # the loop-lag watcher samples every 0.1 s; the requests may all fit inside one interval
    after = samples(get(f"{live.base_url}/metrics")[2])

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta("diffusiond_steps_total") == k * s
    assert delta("diffusiond_step_cache_reused_total") == 0  # no --cache
    assert delta('diffusiond_requests_total{outcome="completed"}') == k
    assert delta('diffusiond_request_duration_seconds_count{outcome="completed"}') == k
    assert delta("diffusiond_queue_wait_seconds_count") == k
    assert delta("diffusiond_batch_size_count") == k * s
    assert delta("diffusiond_batch_size_sum") == k * s
    for stage, count in {
        "queue": k,
        "encode": k,
        "denoise": k * s,
        "sampler": k * s,
        "broadcast": k * s,
        "decode": k,
        "encode_response": k,
    }.items():
        assert delta(f'diffusiond_stage_seconds_count{{stage="{stage}"}}') == count, stage
    assert delta('diffusiond_stage_seconds_sum{stage="denoise"}') > 0
    assert after["diffusiond_requests_running"] == 0 and after["diffusiond_requests_waiting"] == 0
    assert after["diffusiond_event_loop_lag_seconds_count"] > before.get("diffusiond_event_loop_lag_seconds_count", 0)


def test_step_cache_reuses_are_counted(serve):
    """`--cache x0cache` with requests that reuse whenever they may (threshold 10): of 8 steps, 2, 4 and 6 reuse
    (tests/models/test_x0cache.py), so 3 of each request's 8 steps count as reused."""
    cached = serve(cache="x0cache", cache_threshold=10.0)
    cached.wait_idle()
    before = samples(get(f"{cached.base_url}/metrics")[2])
    for seed in range(2):
        generate(cached, steps=8, seed=seed)
    cached.wait_idle()
    after = samples(get(f"{cached.base_url}/metrics")[2])
    delta = {
        key: after[key] - before.get(key, 0.0)
        for key in ("diffusiond_steps_total", "diffusiond_step_cache_reused_total")
    }
    assert delta == {"diffusiond_steps_total": 16, "diffusiond_step_cache_reused_total": 6}, delta


def test_real_prometheus_scrapes_stage_series(live, tmp_path):
    with prometheus_scraping(urllib.parse.urlparse(live.base_url).netloc, tmp_path) as query:
        for seed in range(3):
            generate(live, steps=2, seed=seed)
        deadline = time.monotonic() + 60
        stages: dict[str, float] = {}
        while time.monotonic() < deadline:
            result = query('diffusiond_stage_seconds_count{job="diffusiond"}')
            stages = {r["metric"]["stage"]: float(r["value"][1]) for r in result}
            if stages.get("denoise", 0) > 0 and stages.get("decode", 0) > 0:
                break
            time.sleep(0.5)
        assert set(STAGES) <= set(stages), stages
        assert stages["denoise"] >= 6 and stages["decode"] >= 3, stages
