"""`diffusiond bench compare` end to end on a tiny checkpoint, at the smallest settings (numbers are not checked:
timing claims belong to benchmarks, not tests; this checks that README's command works and reports consistently)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import diffusiond
from diffusiond.__main__ import main


def test_compare_runs_and_reports(tiny_sd3, tmp_path, capsys):
    """With `--against` another tree's daemon runs in the same blocks: here a copy of this one that says it is
    another version, which the report shows (so that daemon really ran from the copy)."""
    tree = tmp_path / "before"
    root = Path(diffusiond.__file__).parent
    skip = shutil.ignore_patterns(".git", ".venv", "build", "tests", "docs", "__pycache__", ".*cache", ".hypothesis")
    shutil.copytree(root, tree, ignore=skip)
    init = tree / "__init__.py"
    init.write_text(
        init.read_text().replace(f'__version__ = "{diffusiond.__version__}"', '__version__ = "0.0.0+before"')
    )
    out = tmp_path / "report.json"
    argv = ["bench", "compare", "--model", tiny_sd3, "--size", "64x64", "--steps", "2", "--guidance-scale", "4.5"]
    argv += ["--repeats", "2", "--block", "1", "--rounds", "1", "--images", "8", "--json", str(out)]
    assert main([*argv, "--against", str(tree)]) == 0
    report = json.loads(out.read_text())
    (png, alone, http), _ = report["single_s"]
    ((sequential, batched, eight),) = report["throughput"]
    assert min(png, alone, http, sequential, batched, eight, report["forward_bound_images_per_s"]) > 0
    assert report["against_version"] == "0.0.0+before"
    assert len(report["against_single_s"]) == 2 and len(report["against_throughput"]) == 1
    assert min(report["against_single_s"] + report["against_throughput"]) > 0
    assert sorted(int(c) for c in report["sweep"]) == [1, 2, 4, 8, 16]
    assert all(s["completed"] == s["requests"] for s in report["sweep"].values())
    table = capsys.readouterr().out
    assert "one request over HTTP" in table and "vs batched calls of 8" in table
    assert "this tree's one request vs --against's" in table and "diffusiond 0.0.0+before" in table


def test_against_must_be_a_source_tree(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "compare", "--against", str(tmp_path)])
