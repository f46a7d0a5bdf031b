"""`python -m diffusiond.bench.priorities` at its smallest settings on the bundled model: it runs end to end and
its report holds what the benchmark claims to measure (the numbers themselves are the benchmark's, not a test's:
docs/performance.md). Pauses happen under the flood with preemption; the burst sent with deadlines is refused
rather than run for nobody; the repeated seeded request is a cache hit (the benchmark asserts `cached`)."""

from __future__ import annotations

import json

from diffusiond.bench.priorities import main


def test_the_priority_benchmark_reports_each_measure(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--interactive", "2", "--flood", "3", "--max-batch", "2", "--flood-steps", "12", "--burst", "3"]
    assert main([*argv, "--patience", "0.02", "--json", str(out)]) == 0  # below 4 steps: refused whatever the machine
    r = json.loads(out.read_text())
    assert not r["video"] and r["idle"]["n"] == r["flood_preemption"]["n"] == r["flood_no_preemption"]["n"] == 2
    assert r["preemptions"] >= 2  # each interactive request paused a flood request
    told, untold = r["with_deadlines"], r["without_deadlines"]
    assert told["sent"] == untold["sent"] == 3 and told["refused"] >= 1 and untold["refused"] == 0
    assert r["cache_hit_s"] < r["cache_miss_s"]
    assert "flood, no preemption" in capsys.readouterr().out


def test_the_video_flood_keeps_its_jobs_in_flight(tiny_wan, tmp_path):
    """On a video model the flood is `/v1/videos` jobs, `--flood` of them in flight to the end (one more sent as each
    completes): the interactive requests under it pause running clips."""
    out = tmp_path / "report.json"
    argv = ["--model", tiny_wan, "--interactive", "2", "--flood", "3", "--max-batch", "2", "--size", "32"]
    argv += ["--steps", "2", "--flood-steps", "200", "--flood-frames", "5", "--burst", "2", "--patience", "0.02"]
    assert main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["video"] and r["flood_preemption"]["n"] == r["flood_no_preemption"]["n"] == 2
    assert r["preemptions"] >= 2
