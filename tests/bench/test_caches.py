"""`diffusiond bench cache` end to end on the bundled model at small settings (numbers are not checked: timing claims
belong to the benchmark's runs, docs/acceleration.md; this checks that the command runs both daemons, alternates
them and reports what each did)."""

from __future__ import annotations

import json

import pytest

from diffusiond.__main__ import main
from diffusiond.bench.caches import parse_config


def test_bench_cache_runs_both_daemons_and_reports(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["bench", "cache", "--configs", "x0cache:0.5", "--steps", "8", "--requests", "8", "--rounds", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    (report,) = json.loads(out.read_text())
    assert len(report["speedups"]) == 2 and min(report["speedups"]) > 0
    assert len(report["uncached"]["seconds"]) == 2 and len(report["cached"]["seconds"]) == 2
    # The cached daemon reused (its own counters) and the uncached one did not: a cache that never skips fails here.
    assert report["uncached"]["reused"] == 0 and report["cached"]["reused"] > 0
    # Its images are near the uncached ones, and not the same images (a daemon without the cache would give those).
    assert 25 < report["psnr_mean"] < 100 and 0.9 < report["ssim_mean"] < 1
    table = capsys.readouterr().out
    assert "x0cache:0.5:" in table and "median over 2 rounds" in table and "PSNR" in table


def test_configurations_are_parsed():
    assert parse_config('dbcache:0.4:{"warmup": 4}') == ("dbcache", 0.4, {"warmup": 4})
    assert parse_config("x0cache:0.2") == ("x0cache", 0.2, {})
    with pytest.raises(SystemExit):
        parse_config("x0cache")
