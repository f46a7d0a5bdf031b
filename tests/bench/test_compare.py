"""`diffusiond bench compare` end to end on a tiny checkpoint, at the smallest settings (numbers are not checked:
timing claims belong to benchmarks, not tests; this checks that README's command works and reports consistently)."""

from __future__ import annotations

import json

from diffusiond.__main__ import main


def test_compare_runs_and_reports(tiny_sd3, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["bench", "compare", "--model", tiny_sd3, "--size", "64x64", "--steps", "2", "--guidance-scale", "4.5"]
    argv += ["--repeats", "1", "--block", "1", "--rounds", "1", "--images", "8", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    ((png, alone, http),) = report["single_s"]
    ((sequential, batched, eight),) = report["throughput"]
    assert min(png, alone, http, sequential, batched, eight, report["forward_bound_images_per_s"]) > 0
    assert sorted(int(c) for c in report["sweep"]) == [1, 2, 4, 8, 16]
    assert all(s["completed"] == s["requests"] for s in report["sweep"].values())
    table = capsys.readouterr().out
    assert "one request over HTTP" in table and "vs batched calls of 8" in table
