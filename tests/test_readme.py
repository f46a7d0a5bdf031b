"""README's code blocks are what users paste first: every command in them runs here (against the bundled model), or
names the test that runs it, or says what it needs (`# needs: ...` on the line, or on the first line of its block).
Synopsis lines (`[--flag ...]`, `...`) are formats, not commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from procs import free_port, wait_ready

from diffusiond.models.default import default_model

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent

# Commands that run elsewhere: a pattern, and the file whose tests (or CI) run them.
ELSEWHERE: list[tuple[str, str]] = [
    (r"make test\b", ".ci/run"),
    (r"pip install -c constraints/cpu\.txt -e '\.\[test\]'", "Makefile"),
    (r"diffusiond serve --nproc 2 --cfg-parallel 2", "tests/spmd/test_serve_ranks.py"),
    (r"diffusiond serve --nproc 2 --ulysses 2", "tests/engine/test_spmd.py"),
    (r"diffusiond serve --nproc 2 --ring 2", "tests/engine/test_spmd.py"),
    (r"diffusiond serve --nproc 2 --tp 2", "tests/engine/test_spmd.py"),
    (r"diffusiond serve --nproc 2 --cfg-parallel 2 --shard-weights", "tests/engine/test_spmd.py"),
    (r"diffusiond serve --nproc 2 --cfg-parallel 2 --vae-parallel 2", "tests/engine/test_spmd.py"),
    (r"torchrun --nproc-per-node 2 -m diffusiond serve", "tests/spmd/test_serve_ranks.py"),
    (r"diffusiond bench compare", "tests/bench/test_compare.py"),
    (r"diffusiond bench serve", "tests/bench/test_serve.py"),
    (r"diffusiond bench spmd", "tests/test_readme.py"),
    (r"diffusiond serve --port 800[12] --unready-delay 2", "tests/deploy/test_haproxy.py"),
    (r"haproxy -f deploy/haproxy/haproxy\.cfg", "tests/deploy/test_haproxy.py"),
    (r"diffusiond serve --cache teacache --scheduler-config", "tests/models/test_demo.py"),
    (r"diffusiond serve --cache (fb|tea)cache", "tests/models/test_stepcache.py"),
    (r"python -m diffusiond\.tools\.calibrate", "tests/models/test_stepcache.py"),
    (r"diffusiond serve --quantize", "tests/kernels/test_quantize.py"),
    (r"pip install -c constraints/cpu\.txt -e '\.\[quant\]'", "tests/service/test_packaging.py"),
    (r"python -m diffusiond\.tools\.cache", "tests/test_readme.py"),
    (r"python -m diffusiond\.tools\.accel", "tests/test_readme.py"),
    (r"python -m diffusiond\.bench\.projections", "tests/test_readme.py"),
    (r"python -m diffusiond\.bench\.strategies", "tests/test_readme.py"),
    (r"diffusiond serve --attention math", "tests/kernels/test_attention.py"),
    (r"diffusiond serve --compile", "tests/kernels/test_compile.py"),
]
# Commands this file runs: a pattern, and the test below that runs it.
HERE: list[tuple[str, str]] = [
    (r"curl ", "test_curl_examples_work_against_the_bundled_model"),
    (r"make run\b", "test_make_run_serves_on_the_given_port"),
    (r"diffusiond generate \"a small red circle", "test_generate_example"),
    (r"diffusiond make-tiny --family sd3 --out /tmp/tiny-sd3", "test_make_tiny_example"),
]


def blocks() -> list[list[str]]:
    """Each ```bash block as its commands (continuation lines joined)."""
    out, current, inside = [], None, False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            if inside:
                current = []
            else:
                out.append(current)
            continue
        if inside:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1].rstrip() + " " + line.strip()
            else:
                current.append(line)
    return out


def commands() -> list[tuple[str, bool]]:
    """(command, marked as needing something) for every command line of README's code blocks."""
    out = []
    for block in blocks():
        block_needs = bool(block) and block[0].startswith("# needs:")
        for line in block:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            comment = line.split(" #", 1)[1] if " #" in line else ""
            out.append((line.strip(), block_needs or "needs:" in comment))
    return out


def synopsis(command: str) -> bool:
    return " [--" in command or command.endswith("...") or " ... " in command or command.startswith("[--")


def test_every_readme_command_is_run_or_says_what_it_needs():
    unaccounted = []
    for command, needs in commands():
        if needs or synopsis(command):
            continue
        if any(re.match(pattern, command) for pattern, _ in HERE):
            continue
        where = [path for pattern, path in ELSEWHERE if re.match(pattern, command)]
        if not where:
            unaccounted.append(command)
            continue
        assert (ROOT / where[0]).exists(), (command, where[0])
    assert not unaccounted, "README commands that no test runs and that say nothing of what they need:\n" + "\n".join(
        unaccounted
    )


def readme_commands(prefix: str) -> list[str]:
    found = [c for c, needs in commands() if c.startswith(prefix) and not needs and not synopsis(c)]
    assert found, f"README has no {prefix!r} command any more: update this test"
    return found


@pytest.fixture(scope="module")
def demo(serve):
    return serve(model=default_model(), max_steps=None)


def run(command: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, timeout=timeout, check=False)


def test_curl_examples_work_against_the_bundled_model(demo, tmp_path):
    for command in readme_commands("curl "):
        result = run(command.replace("localhost:8000", f"127.0.0.1:{demo.port}"), tmp_path)
        out = result.stdout.decode(errors="replace")
        assert result.returncode == 0, (command, result.stderr)
        if "> " in command:  # writes an image
            name = command.rsplit("> ", 1)[1].strip()
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", command
        elif "/v1/generations" in command:  # an SSE stream
            assert "event: completed" in out and "X-Unknown-Words" not in out, (command, out[-500:])
            assert '"unknown_words"' not in out, command  # README's prompts are ones the model knows
        else:
            body = json.loads(out)
            assert "error" not in body, (command, body)


def test_generate_example(tmp_path):
    (command,) = [c for c in readme_commands("diffusiond generate ") if "--model" not in c]
    result = run(command, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "out.png").exists() and any((tmp_path / "previews").iterdir())
    assert b"does not know" not in result.stderr


def test_make_tiny_example(tmp_path):
    (command,) = {c.split("#")[0].strip() for c in readme_commands("diffusiond make-tiny ")}
    result = run(command.replace("/tmp/tiny-sd3", str(tmp_path / "tiny-sd3")), tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "tiny-sd3" / "model_index.json").exists()


@pytest.mark.slow
def test_make_run_serves_on_the_given_port(tmp_path):
    """`make run PORT=...` as README gives it (the venv is already set up: make must not reinstall it)."""
    (command,) = readme_commands("make run PORT=")
    port = free_port()
    argv = shlex.split(command.split("#")[0].replace("8080", str(port)))
    venv = Path(sys.prefix)
    argv += [f"VENV={venv}", "-o", f"{venv}/.installed"]
    log = tmp_path / "make.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, within=120)
        except AssertionError as exc:
            raise AssertionError(f"make run never got ready\n{log.read_text()}") from exc
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


@pytest.mark.slow
def test_bench_spmd_example(tmp_path):
    """README's `diffusiond bench spmd`, at its smallest settings (the numbers are not checked)."""
    readme_commands("diffusiond bench spmd")
    cmd = "diffusiond bench spmd --images 4 --steps 4 --plans 50"
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


@pytest.mark.slow
def test_bench_accel_example(tmp_path):
    """README's acceleration benchmark, at its smallest settings (the numbers are not checked): each configuration
    in a child process of its own, every row reported."""
    (command,) = readme_commands("python -m diffusiond.tools.accel --scheduler-config")
    configs = "exact,teacache:0.4,int8"
    cmd = f"{sys.executable} -m diffusiond.tools.accel --requests 2 --repeats 1 --steps 8 --configs {configs}"
    cmd += " " + command.split("#")[0].split("tools.accel", 1)[1].strip()  # README's --scheduler-config
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    for config in configs.split(","):
        assert f'"config": "{config}"'.encode() in result.stdout
    # Deterministic sampling, as the flag asks: the cache reuses a quarter of the steps (without the flag: none).
    (cached,) = [json.loads(line) for line in result.stdout.splitlines() if b'"config": "teacache:0.4"' in line]
    assert cached["reused"] > 0, cached


@pytest.mark.slow
def test_bench_cache_example(tmp_path):
    """README's step-cache benchmark, at its smallest settings (the numbers are not checked)."""
    readme_commands("python -m diffusiond.tools.cache")
    cmd = (
        f"{sys.executable} -m diffusiond.tools.cache --requests 2 --repeats 1 --steps 4 --thresholds 0.4 "
        "--teacache-thresholds 0.3"
    )
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b'"method":"fbcache","threshold":0.4' in result.stdout
    assert b'"method":"teacache","threshold":0.3' in result.stdout


@pytest.mark.slow
def test_bench_projections_example(tmp_path):
    """README's projection-reuse benchmark, with a small transformer (the numbers are not checked)."""
    readme_commands("python -m diffusiond.bench.projections")
    cmd = (
        f"{sys.executable} -m diffusiond.bench.projections --layers 1 --dim 96 --heads 2 --ffn 64 --text-dim 64 "
        "--size 32x32 --frames 5 --steps 2 --batch 1"
    )
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b"per step: projected every step" in result.stdout and b"ratio" in result.stdout


@pytest.mark.slow
def test_bench_strategies_example(tmp_path):
    """README's strategies benchmark, two layouts, few steps (the numbers are not checked)."""
    readme_commands("python -m diffusiond.bench.strategies")
    cmd = f"{sys.executable} -m diffusiond.bench.strategies --layouts '1 rank,tp 2' --steps 4 --requests 1"
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b"1 rank" in result.stdout and b"tp 2" in result.stdout
