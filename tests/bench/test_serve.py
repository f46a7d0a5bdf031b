"""`diffusiond bench serve` against a live daemon: its numbers add up, and refusals are counted, not raised."""

from __future__ import annotations

import json

from diffusiond.__main__ import main


def bench(server, tmp_path, *flags: str) -> dict:
    out = tmp_path / "summary.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--size", "64x64", "--steps", "2", "--no-progress"]
    assert main([*argv, "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def ordered(latency: dict) -> bool:
    return latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]


def test_summary_adds_up(server, tmp_path, capsys):
    s = bench(server, tmp_path, "--num-requests", "6", "--concurrency", "3", "--slo", "30")
    assert s["requests"] == 6 and s["completed"] + s["failed"] == 6 and s["completed"] == 6, s
    assert ordered(s["latency_s"]) and s["images_per_s"] > 0
    assert s["slo_attainment"] == 1.0 and s["queue_wait_mean_s"] is not None
    table = capsys.readouterr().out
    assert "completed / failed" in table and "6 / 0" in table


def test_streaming_measures_time_to_first_preview(server, tmp_path):
    s = bench(server, tmp_path, "--num-requests", "4", "--api", "native", "--stream", "--steps", "3")
    assert s["completed"] == 4
    ttfp = s["time_to_first_preview_s"]
    assert ordered(ttfp) and ttfp["max"] <= s["latency_s"]["max"]
    s = bench(server, tmp_path, "--num-requests", "2", "--stream", "--steps", "3")  # OpenAI partial images
    assert s["completed"] == 2 and s["time_to_first_preview_s"] is not None


def test_refusals_are_counted(small_server, tmp_path):
    """max_batch 1, max_queue 1: eight at once get 429s, which the summary reports as refusals."""
    s = bench(small_server, tmp_path, "--num-requests", "12", "--concurrency", "8")
    assert s["completed"] + s["failed"] == 12
    assert s["refused"].get("429", 0) == s["failed"] > 0 and not s["errors"], s


def test_poisson_arrivals_and_a_workload_file(server, tmp_path):
    workload = tmp_path / "mix.jsonl"
    lines = [
        {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2},
        {"prompt": "a blue square", "size": "32x32", "num_inference_steps": 3, "n": 2},
    ]
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    s = bench(server, tmp_path, "--num-requests", "4", "--request-rate", "50", "--workload", str(workload))
    assert s["completed"] == 4 and s["request_rate"] == 50 and s["concurrency"] is None
    assert abs(s["images_per_s"] * s["duration_s"] - 6) < 1e-6  # 2 x 1 image + 2 x 2 images


def test_a_mixed_workload_is_reported_group_by_group(server, tmp_path, capsys):
    """Classes and tenants in one workload: each line's `_group` (else its class) gets its own numbers; `_group`
    and `_api_key` never reach the daemon (it refuses unknown fields)."""
    workload = tmp_path / "mix.jsonl"
    lines = [
        {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2, "priority": 9, "_group": "urgent"},
        {"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2, "priority": 0, "_api_key": "k"},
        {"prompt": "a green disc", "size": "64x64", "num_inference_steps": 2},
    ]
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    s = bench(server, tmp_path, "--num-requests", "6", "--workload", str(workload), "--slo", "60")
    assert s["completed"] == 6, s
    assert sorted(s["groups"]) == ["priority -", "priority 0", "urgent"]
    for group in s["groups"].values():
        assert group["requests"] == group["completed"] == 2 and group["slo_attainment"] == 1.0
        assert ordered(group["latency_s"])
    assert "[urgent]" in capsys.readouterr().out


def test_serving_never_imports_the_bench_package():
    import subprocess
    import sys

    code = (
        "import sys; from diffusiond.daemon.cli import build_parser;"
        "build_parser().parse_args(['serve']);"
        "sys.exit(any(m.startswith('diffusiond.bench') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
