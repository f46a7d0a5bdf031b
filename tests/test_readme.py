"""README's and docs/'s command blocks are what users paste first: every command in them runs here (against the
bundled model), or names the test that runs it, or says what it needs (`# needs: ...` on the line, or on the first line
of its block). Synopsis lines (`[--flag ...]`, `...`) are formats, not commands. README stays a short page whose links
lead to the rest: every relative link of README and docs/ points at a file that exists."""

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
DOCS = ROOT / "docs"
# README and every page directly in docs/: the pages whose command blocks are checked and whose links must resolve.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# The topics README links to, one docs page each (architecture.md is its own author's).
TOPICS = [
    "http-api.md",
    "service.md",
    "ranks.md",
    "replicas.md",
    "video.md",
    "lora.md",
    "acceleration.md",
    "metrics.md",
    "performance.md",
    "correctness.md",
    "architecture.md",
]
README_MAX_CHARS = 15_000
# A fence that opens a command block; other fenced blocks (diagrams, file trees, Python) are not commands.
SHELL_FENCE = re.compile(r"```(bash|sh|shell|console)\s*$")
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
    (r"diffusiond bench cache", "tests/bench/test_caches.py"),
    (r"python -m diffusiond\.bench\.gpu_check --device cpu", "tests/bench/test_gpu_check.py"),
    (r"diffusiond bench serve", "tests/bench/test_serve.py"),
    (r"python -m diffusiond\.bench\.priorities", "tests/bench/test_priorities.py"),
    (r"python -m diffusiond\.tools\.dashboard", "tests/metrics/test_dashboard.py"),
    (r"diffusiond bench spmd", "tests/test_readme.py"),
    (r"diffusiond serve --port 800[12] --unready-delay 2", "tests/deploy/test_haproxy.py"),
    (r"haproxy -f deploy/haproxy/haproxy\.cfg", "tests/deploy/test_haproxy.py"),
    (r"diffusiond serve --cache teacache --scheduler-config", "tests/models/test_demo.py"),
    (r"diffusiond serve( --model \S+)? --cache (fb|tea|db|x0|mag)cache", "tests/models/test_stepcache.py"),
    (r"python -m diffusiond\.tools\.calibrate --method magcache", "tests/models/test_magcache.py"),
    (r"python -m diffusiond\.tools\.calibrate", "tests/models/test_stepcache.py"),
    (r"diffusiond serve --quantize", "tests/kernels/test_quantize.py"),
    (r"pip install -c constraints/cpu\.txt -e '\.\[quant\]'", "tests/service/test_packaging.py"),
    (r"python -m diffusiond\.tools\.cache", "tests/test_readme.py"),
    (r"python -m diffusiond\.tools\.accel", "tests/test_readme.py"),
    (r"python -m diffusiond\.bench\.projections", "tests/test_readme.py"),
    (r"python -m diffusiond\.bench\.strategies", "tests/test_readme.py"),
    (r"diffusiond serve --attention math", "tests/kernels/test_attention.py"),
    (r"diffusiond serve --served-model-name", "tests/daemon/test_capabilities.py"),
    (r"diffusiond serve --compile", "tests/kernels/test_compile.py"),
]
# Commands this file runs: a pattern, and the test below that runs it.
HERE: list[tuple[str, str]] = [
    (r"curl ", "test_curl_examples_work_against_the_bundled_model"),
    (r"make run\b", "test_make_run_serves_on_the_given_port"),
    (r"diffusiond generate \"a small red circle", "test_generate_example"),
    (r"diffusiond make-tiny --family sd3 --out /tmp/tiny-sd3", "test_make_tiny_example"),
]


def fenced(page: Path) -> list[tuple[str, list[str]]]:
    """Each fenced block of a page: its opening fence, and its lines (continuation lines joined)."""
    out, current, fence = [], None, None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, current = line, []
            else:
                out.append((fence, current))
                fence = None
            continue
        if fence is not None:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1].rstrip() + " " + line.strip()
            else:
                current.append(line)
    assert fence is None, f"{page.name}: a code block is never closed"
    return out


def blocks(page: Path = README) -> list[list[str]]:
    """Each command block (```bash, ```sh...) of a page as its commands."""
    return [lines for fence, lines in fenced(page) if SHELL_FENCE.fullmatch(fence)]


def commands(pages: list[Path] = PAGES) -> list[tuple[str, bool, Path]]:
    """(command, marked as needing something, page) for every command line of the pages' command blocks."""
    out = []
    for page in pages:
        for block in blocks(page):
            block_needs = bool(block) and block[0].startswith("# needs:")
            for line in block:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                comment = line.split(" #", 1)[1] if " #" in line else ""
                out.append((line.strip(), block_needs or "needs:" in comment, page))
    return out


def synopsis(command: str) -> bool:
    return " [--" in command or command.endswith("...") or " ... " in command or command.startswith("[--")


def test_every_readme_command_is_run_or_says_what_it_needs():
    """README's and every docs page's: each command runs in a test, is a synopsis, or says what it needs."""
    unaccounted = []
    for command, needs, page in commands():
        if needs or synopsis(command):
            continue
        here = [test for pattern, test in HERE if re.match(pattern, command)]
        if here:
            assert callable(globals().get(here[0])), (command, here[0])
            continue
        where = [path for pattern, path in ELSEWHERE if re.match(pattern, command)]
        if not where:
            unaccounted.append(f"{page.relative_to(ROOT)}: {command}")
            continue
        assert (ROOT / where[0]).exists(), (command, where[0])
    assert not unaccounted, "Commands that no test runs and that say nothing of what they need:\n" + "\n".join(
        unaccounted
    )


def test_readme_code_blocks_are_all_command_blocks():
    """Every fenced block of README is a ```bash block, so the rule above covers all of README's code."""
    fences = [fence for fence, _ in fenced(README)]
    assert fences and all(fence == "```bash" for fence in fences), fences


def doc_commands(prefix: str, pages: list[Path] = PAGES) -> list[str]:
    """The runnable commands (no `needs:`, not a synopsis) of the pages that start with `prefix`."""
    found = [c for c, needs, _ in commands(pages) if c.startswith(prefix) and not needs and not synopsis(c)]
    where = "README" if pages == [README] else "README and docs/"
    assert found, f"{where} has no {prefix!r} command any more: update this test"
    return found


def test_first_requests_stay_in_readme():
    """The two set-up commands open README, and its first requests are README's own, not a docs page's."""
    first = [line.split("#")[0].strip() for line in blocks(README)[0]]
    assert first == ["make run", "make test"], first
    for prefix in ("curl ", "make run PORT=", "diffusiond generate ", "diffusiond make-tiny "):
        doc_commands(prefix, [README])
    assert "playground" in README.read_text()


def test_readme_is_short():
    size = len(README.read_text())
    assert size < README_MAX_CHARS, (
        f"README.md is {size} characters, not under {README_MAX_CHARS}: move a topic into docs/"
    )


def links(page: Path) -> list[str]:
    """The link targets of a page's Markdown (inline links and images, reference definitions), outside code."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text) + re.findall(
        r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, flags=re.M
    )


def test_readme_links_every_docs_topic():
    """README links each topic's page, every page in docs/ is linked from README, and each linked page exists."""
    linked = {target.split("#")[0] for target in links(README)}
    for topic in TOPICS:
        assert f"docs/{topic}" in linked, f"README does not link docs/{topic}"
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in linked, f"README links no page docs/{page.name}"
    for target in sorted(linked):
        if target.startswith("docs/") and target.endswith(".md"):
            assert (ROOT / target).is_file(), f"README links {target}, which does not exist"


def test_relative_links_point_at_files_that_exist():
    """Every relative link (images too) of README and docs/*.md resolves from its page's folder."""
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # http(s), mailto...: not a file; an anchor of the page itself
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "Relative links to nothing:\n" + "\n".join(broken)


def video_blocks(text: str) -> list[str]:
    """The bash blocks of a text that drive a video model, as text (as tests/daemon/test_videos.py reads them)."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [block for block in blocks if block.startswith("# needs: a video model")]


def test_video_page_examples_equal_readmes():
    """tests/daemon/test_videos.py runs README's Video section; docs/video.md shows the same blocks."""
    readme = README.read_text().split("### Video\n", 1)[1].split("\n## ", 1)[0]
    page = DOCS / "video.md"
    ours = video_blocks(readme)
    assert len(ours) == 2, ours
    assert video_blocks(page.read_text()) == ours


@pytest.fixture(scope="module")
def demo(serve):
    return serve(model=default_model(), max_steps=None)


def run(command: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, timeout=timeout, check=False)


def test_curl_examples_work_against_the_bundled_model(demo, tmp_path):
    for command in doc_commands("curl "):
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
    (command,) = [c for c in doc_commands("diffusiond generate ") if "--model" not in c]
    result = run(command, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "out.png").exists() and any((tmp_path / "previews").iterdir())
    assert b"does not know" not in result.stderr


def test_make_tiny_example(tmp_path):
    from diffusiond.models.tiny import FAMILIES

    (command,) = {c.split("#")[0].strip() for c in doc_commands("diffusiond make-tiny ")}
    # README's comment lists every family make-tiny writes (it fell behind as families were added).
    (line,) = doc_commands("diffusiond make-tiny ", [README])
    listed = ["sd3", *line.split("#")[1].strip().removeprefix("or ").split(", ")]
    assert sorted(listed) == sorted(FAMILIES), (listed, FAMILIES)
    result = run(command.replace("/tmp/tiny-sd3", str(tmp_path / "tiny-sd3")), tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "tiny-sd3" / "model_index.json").exists()
    # A family of the generic path, which fits no preview file (it exited 1 after writing the folder)
    generic = command.replace("sd3", "sd15").replace("/tmp/tiny-sd15", str(tmp_path / "tiny-sd15"))
    result = run(generic, tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "tiny-sd15" / "model_index.json").exists()


@pytest.mark.slow
def test_make_run_serves_on_the_given_port(tmp_path):
    """`make run PORT=...` as README gives it (the venv is already set up: make must not reinstall it)."""
    (command,) = doc_commands("make run PORT=")
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
    """The documented `diffusiond bench spmd`, at its smallest settings (the numbers are not checked)."""
    doc_commands("diffusiond bench spmd")
    cmd = "diffusiond bench spmd --images 4 --steps 4 --plans 50"
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


@pytest.mark.slow
def test_bench_accel_example(tmp_path):
    """docs/acceleration.md's benchmark, at its smallest settings (the numbers are not checked): each configuration
    in a child process of its own, every row reported."""
    (command,) = doc_commands("python -m diffusiond.tools.accel --scheduler-config")
    # Four child processes (exact runs first and last): a cache with int8, DBCache with its forecast and step mask.
    configs = "exact,int8+teacache:0.4,dbcache:0.4+taylorseer+scm-fast"
    cmd = f"{sys.executable} -m diffusiond.tools.accel --requests 2 --repeats 1 --steps 8 --configs {configs}"
    cmd += " " + command.split("#")[0].split("tools.accel", 1)[1].strip()  # the page's --scheduler-config
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    for config in configs.split(","):
        assert f'"config": "{config}"'.encode() in result.stdout
    # Deterministic sampling, as the flag asks: the cache reuses a quarter of the steps (without the flag: none).
    (cached,) = [json.loads(line) for line in result.stdout.splitlines() if b'"config": "int8+teacache:0.4"' in line]
    assert cached["reused"] > 0, cached


@pytest.mark.slow
def test_bench_cache_example(tmp_path):
    """docs/acceleration.md's step-cache benchmark, at its smallest settings (the numbers are not checked)."""
    doc_commands("python -m diffusiond.tools.cache")
    cmd = (
        f"{sys.executable} -m diffusiond.tools.cache --requests 2 --repeats 1 --steps 4 --thresholds 0.4 "
        "--teacache-thresholds 0.3 --methods fbcache,teacache,dbcache+taylorseer"
    )
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b'"method":"fbcache","threshold":0.4' in result.stdout
    assert b'"method":"dbcache {\\"taylorseer\\": true, \\"taylorseer_order\\": 1}","threshold":0.4' in result.stdout
    assert b'"method":"teacache","threshold":0.3' in result.stdout


@pytest.mark.slow
def test_bench_projections_example(tmp_path):
    """docs/video.md's projection-reuse benchmark, with a small transformer (the numbers are not checked)."""
    doc_commands("python -m diffusiond.bench.projections")
    cmd = (
        f"{sys.executable} -m diffusiond.bench.projections --layers 1 --dim 96 --heads 2 --ffn 64 --text-dim 64 "
        "--size 32x32 --frames 5 --steps 2 --batch 1"
    )
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b"per step: projected every step" in result.stdout and b"ratio" in result.stdout


@pytest.mark.slow
def test_bench_strategies_example(tmp_path):
    """docs/ranks.md's strategies benchmark, two layouts, few steps (the numbers are not checked)."""
    doc_commands("python -m diffusiond.bench.strategies")
    cmd = f"{sys.executable} -m diffusiond.bench.strategies --layouts '1 rank,tp 2' --steps 4 --requests 1"
    result = run(cmd, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b"1 rank" in result.stdout and b"tp 2" in result.stdout
