"""bench/gpu_check.py, the GPU acceptance check, run on the CPU for its structure (issue 31): every row is there,
the rows that need CUDA say so, and the others pass here (families load, two steps under each kernel that runs
here, a served run, one request against a clean diffusers process, the plan broadcast and fault board)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CUDA_ONLY = {
    "host syncs per step",
    "--compile: warm-up, recompiles",
    "--quantize int8",
    "--quantize fp8",
    "--quantize fp8 qwen-image",
    "--quantize fp8 z-image",
    "--offload model",
    "--offload group",
    "decode 8 x 1024x1024 (SD3 VAE)",
    "decode a Wan clip 81x480x832",
    "decode 1024x1024, channels-last vs as loaded",
}


def test_the_gpu_check_runs_on_a_cpu_and_says_what_it_skipped(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    proc = subprocess.run(
        [sys.executable, "-m", "diffusiond.bench.gpu_check", "--device", "cpu", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.read_text())}
    from diffusiond.bench.gpu_check import FAMILIES

    expected = {
        "environment",
        *(f"load {f} (float32)" for f in FAMILIES),
        *(f"two steps {f}, every kernel" for f in FAMILIES),
        "served: 8 streams with previews",
        "one request vs a clean diffusers process",
        "plan broadcast, fault board",
        *CUDA_ONLY,
    }
    assert set(rows) == expected
    for name, row in rows.items():
        if name in CUDA_ONLY:
            assert (row["status"], row["found"]) == ("skipped", "needs CUDA"), row
        else:
            assert row["status"] == "ok", row
    assert "vs sdpa: math 0.000" in rows["two steps qwen-image, every kernel"]["found"]
    assert "8 of 8 completed" in rows["served: 8 streams with previews"]["found"]
    assert "| " not in proc.stdout and "35 rows: 0 failed" in proc.stdout
