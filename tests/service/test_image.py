"""The CPU image, built and run for real: the Dockerfile (its CPU arguments: docs/service.md) built with buildah on a
Debian base made by debootstrap from Debian's own packages (no registry is reachable here), then its container run
with buildah's chroot isolation (`podman run` cannot start containers on these machines: ../shared/FACTS.md). It
serves the bundled model as its entrypoint starts it, /ready turns ready, a generation answers a PNG, the health
check command the image declares passes, the daemon runs as the image's non-root user, and SIGTERM drains a request
in flight and exits 0 with no traceback. What the CUDA image does not share with this one is in docs/service.md.

Cached between runs on one machine (the CI machine is this one): the debootstrap base (kept a week: Debian's
packages, rebuilt after), and the build's layers (`--layers`): the deps stage (torch and the dependencies, which
only pyproject.toml and the arguments change) is tagged, and the image stays tagged until the next run, so that its
runtime stage (which copies the deps) is the next build's cache too: a change of diffusiond's code rebuilds the
small layers only. Layers no tag holds are removed after each run.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
from needs import missing
from PIL import Image
from procs import children, free_port, get, kill_tree, stream, wait_ready

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/diffusiond-ci/debian-base:bookworm"
IMAGE = "localhost/diffusiond-ci/image:cpu-test"
DEPS = "localhost/diffusiond-ci/deps:cpu"
BASE_MAX_AGE_S = 7 * 86400
API_KEY = "image-test-key"
# The image's Python is Debian bookworm's (3.11): a CPU build of torch for it, from a folder of wheels.
TORCH_WHEEL = "torch-*+cpu-cp311-cp311-manylinux*_x86_64.whl"


def _run(*cmd: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd[:4])} ... exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result


def _torch_wheel() -> Path | None:
    """A CPU torch wheel for the image, from the folders pip finds wheels in here (PIP_FIND_LINKS)."""
    folders = [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]
    for folder in folders:
        found = sorted(Path(folder).glob(TORCH_WHEEL)) if Path(folder).is_dir() else []
        if found:
            return found[-1]
    return None


def _image_created(name: str) -> datetime | None:
    result = _run("buildah", "inspect", "--type", "image", name, check=False, timeout=60)
    if result.returncode != 0:
        return None
    created = json.loads(result.stdout)["OCIv1"]["created"]
    return datetime.fromisoformat(created.replace("Z", "+00:00"))


def _base() -> None:
    """Debian bookworm's minimal base, made by debootstrap, committed as an image; reused while under a week old.
    pip in the build trusts what pip trusts here (PIP_CERT: this machine's network answers TLS with its own CA)."""
    created = _image_created(BASE)
    if created is not None and (datetime.now(UTC) - created).total_seconds() < BASE_MAX_AGE_S:
        return
    with tempfile.TemporaryDirectory(prefix="diffusiond-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run("debootstrap", "--variant=minbase", "bookworm", str(rootfs), timeout=900)
        cert = os.environ.get("PIP_CERT")
        if cert and Path(cert).is_file():
            shutil.copy(cert, rootfs / "etc/pip-ca.crt")
            (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/pip-ca.crt\n")
        tar = Path(tmp) / "rootfs.tar"
        _run("tar", "-C", str(rootfs), "-cf", str(tar), ".", timeout=300)
        ctr = _run("buildah", "from", "scratch").stdout.strip()
        try:
            _run("buildah", "add", "--quiet", ctr, str(tar), "/", timeout=300)
            _run("buildah", "config", "--env", "LANG=C.UTF-8", ctr)
            _run("buildah", "commit", "--quiet", "--rm", ctr, BASE, timeout=300)
        except BaseException:
            _run("buildah", "rm", ctr, check=False)
            raise


def _build(wheel: Path) -> None:
    args = {
        "BUILD_BASE": BASE,
        "RUNTIME_BASE": BASE,
        "TORCH": f"/wheels/{wheel.name}",
        "EXTRAS": "postgres",
        "DEVICE": "cpu",
        "DTYPE": "float32",
    }
    flags = ["--layers", "--isolation", "chroot", "--format", "docker", "-v", f"{wheel.parent}:/wheels:ro"]
    flags += [f"--build-arg={k}={v}" for k, v in args.items()]
    # The deps stage is tagged on its own: it is not an ancestor of the image (a stage copied from), so no tag on
    # the image keeps it. Built first, it is the image's build's cache.
    _run("buildah", "bud", *flags, "--target", "deps", "-t", DEPS, str(ROOT), timeout=1800)
    _run("buildah", "bud", *flags, "-t", IMAGE, str(ROOT), timeout=1800)


@pytest.fixture(scope="module")
def image():
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            missing(f"{tool} not installed (Debian: apt-get install buildah debootstrap)")
    wheel = _torch_wheel()
    if wheel is None:
        missing(f"no CPU torch wheel ({TORCH_WHEEL}) in PIP_FIND_LINKS or /opt/wheels")
    t0 = time.monotonic()
    _base()
    _build(wheel)
    print(f"\nimage built in {time.monotonic() - t0:.0f} s")
    yield json.loads(_run("buildah", "inspect", "--type", "image", IMAGE).stdout)
    # The image stays tagged until the next run's replaces it: its layers (the deps, the runtime stage that copies
    # them) are that run's cache. What no tag holds (the previous run's image, wheel stages) goes.
    _run("buildah", "rmi", "--prune", check=False, timeout=300)


def _daemon_pids(root: int) -> list[int]:
    """The container's daemon processes (run by `buildah run`, pid `root`), first process first: their command runs
    the image's own virtual environment (not buildah's helper, buildah-chroot-exec, which execs the entrypoint and
    passes no signal on)."""
    pids = []
    for pid in children(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline[0].startswith(b"/opt/diffusiond/bin/python") and b"serve" in cmdline:
            pids.append(pid)
    return pids


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip


def test_the_cpu_image_serves_the_bundled_model_as_a_user_and_drains_on_sigterm(image):
    config = image["Docker"]["config"]
    entrypoint, cmd = config["Entrypoint"], config.get("Cmd") or []
    assert entrypoint == ["diffusiond", "serve"] and config["User"] == "10001:10001"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["DIFFUSIOND_DEVICE"] == "cpu" and env["DIFFUSIOND_HOST"] == "0.0.0.0"
    health = config["Healthcheck"]["Test"]
    assert health[0] == "CMD" and "/health" in " ".join(health)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ctr = _run("buildah", "from", IMAGE).stdout.strip()
    run_env = ["--env", f"DIFFUSIOND_PORT={port}", "--env", f"DIFFUSIOND_API_KEY={API_KEY}"]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (read after the process ends, closed with the test)
    proc = subprocess.Popen(
        ["buildah", "run", "--isolation", "chroot", *run_env, ctr, "--", *entrypoint, *cmd],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        try:
            wait_ready(base, proc, within=240)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{_tail(log)}") from None

        pids = _daemon_pids(proc.pid)
        assert pids and all(_uid(pid) == 10001 for pid in pids), [(pid, _uid(pid)) for pid in pids]

        status, body = get(_post(base + "/v1/images/generations", {"prompt": "a red circle", "seed": 1}), 60)
        assert status == 200, body[:500]
        png = base64.b64decode(json.loads(body)["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG") and Image.open(io.BytesIO(png)).size == (64, 64)
        status, body = get(base + "/v1/models")  # the key is asked for beyond loopback
        assert status == 401, body[:300]

        # The health check as the image declares it, inside the container.
        checked = _run("buildah", "run", "--isolation", "chroot", *run_env, ctr, "--", *health[1:], check=False)
        assert checked.returncode == 0, checked.stdout + checked.stderr

        # SIGTERM while a request runs: it finishes (its stream ends completed), then the daemon exits 0.
        events: list[str] = []
        started = threading.Event()

        def read() -> None:
            body = {"prompt": "a blue box", "num_inference_steps": 50, "seed": 2}
            for name, _ in stream(base, body, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}):
                events.append(name)
                if name == "progress":
                    started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60), events
        os.kill(pids[0], signal.SIGTERM)  # what `docker stop` sends the entrypoint's process
        reader.join(120)
        assert events[-1] == "completed", (events, _tail(log))
        assert proc.wait(90) == 0, _tail(log)
        assert b"Traceback" not in _read(log), _tail(log)
    finally:
        if proc.poll() is None:
            kill_tree(proc)  # the container's processes outlive buildah's own
        _run("buildah", "rm", ctr, check=False)
        log.close()


def _read(log) -> bytes:
    log.seek(0)
    return log.read()


def _tail(log) -> str:
    return _read(log)[-4000:].decode(errors="replace")
