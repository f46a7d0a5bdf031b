"""`diffusiond serve --nproc 2` for real: two gloo ranks under the elastic agent, rank 0 serving HTTP.

Faults: a killed follower fails the request in flight with a terminal event (no client hangs), the agent restarts
the group and the daemon is ready again; SIGTERM ends every process within the drain deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from exposition import samples
from procs import Client, free_port, get, kill_tree, rank_pid, stream, terminal_events, wait_ready

FAULTS = Path(__file__).with_name("faults")


@pytest.fixture
def daemon(tiny_sd3, tmp_path):
    yield from start_daemon(tiny_sd3, tmp_path, {})


@pytest.fixture
def daemon_of_one(tiny_sd3, tmp_path):
    """One request per batch: the next one waits in the queue, not started, while one runs."""
    yield from start_daemon(tiny_sd3, tmp_path, {}, ["--cfg-parallel", "2", "--max-batch", "1"])


@pytest.fixture
def faulty_daemon(tiny_sd3, tmp_path):
    """Rank 1 raises in prepare or denoise for prompts that ask for it (faults/sitecustomize.py)."""
    pythonpath = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
    yield from start_daemon(tiny_sd3, tmp_path, {"PYTHONPATH": pythonpath, "FAULT_INJECT_RANK": "1"})


# Each strategy's collectives in a dead rank's absence: all-to-all (Ulysses), send/recv (ring), all-reduce (TP),
# all-gathers of weights (sharded), halo exchange (VAE strips).
STRATEGIES = {
    "ulysses": ["--ulysses", "2"],
    "ring": ["--ring", "2"],
    "tp": ["--tp", "2"],
    "shard-weights": ["--cfg-parallel", "2", "--shard-weights"],
    "vae-parallel": ["--cfg-parallel", "2", "--vae-parallel", "2"],
}


@pytest.fixture(params=list(STRATEGIES))
def strategy_daemon(request, tiny_sd3, tmp_path):
    yield from start_daemon(tiny_sd3, tmp_path, {}, STRATEGIES[request.param])


def start_daemon(tiny_sd3, tmp_path, extra_env: dict[str, str], layout: list[str] | None = None):
    port = free_port()
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115 - closed in the finalizer
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFUSIOND_CACHE": str(tmp_path / "cache"), **extra_env}
    env = {k: v for k, v in env.items() if not k.startswith("DIFFUSIOND_") or k == "DIFFUSIOND_CACHE"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffusiond",
            "serve",
            "--model",
            tiny_sd3,
            "--port",
            str(port),
            "--nproc",
            "2",
            *(layout or ["--cfg-parallel", "2"]),
            "--max-restarts",
            "3",
            "--drain-timeout",
            "5",
            "--max-steps",
            "1000",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield proc, base, tmp_path / "daemon.log"
    finally:
        kill_tree(proc)
        log.close()


def test_two_ranks_serve_and_survive_a_dead_rank(daemon_of_one):
    survive_a_dead_rank(*daemon_of_one)
    # The same daemon (one start less in CI): a heal with requests waiting, then one from an idle group.
    queued_requests_outlive_a_heal(*daemon_of_one)
    a_heal_refuses_no_connection(*daemon_of_one)


def test_every_strategy_survives_a_dead_rank(strategy_daemon):
    """Under each strategy a killed follower fails the request in flight (one terminal event) and the group comes
    back ready (requests finish alone, so under --vae-parallel they decode in strips)."""
    proc, base, log = strategy_daemon
    # FSDP2 keeps no weights for a heal (their storage is FSDP's): that heal reads the checkpoint again.
    survive_a_dead_rank(proc, base, log, kept="--shard-weights" not in proc.args)


def survive_a_dead_rank(proc, base, log, kept: bool = True) -> None:
    events = list(
        stream(
            base,
            {
                "prompt": "a red circle",
                "width": 64,
                "height": 64,
                "num_inference_steps": 4,
                "guidance_scale": 5.0,
                "seed": 1,
            },
        )
    )
    assert events[-1][0] == "completed", events[-1]

    follower = rank_pid(proc.pid, 1)
    assert follower is not None, "rank 1 not found"
    long = stream(
        base,
        {"prompt": "a long one", "width": 64, "height": 64, "num_inference_steps": 1000, "guidance_scale": 5.0},
        timeout=30,
    )
    names = []
    for name, data in long:
        names.append(name)
        if name == "progress" and data["step"] == 2:
            os.kill(follower, signal.SIGKILL)
            killed_at = time.monotonic()
    failed_after = time.monotonic() - killed_at
    # The stream ended (no hang) with exactly one terminal event, a failure.
    terminal = [n for n in names if n in ("completed", "cancelled", "failed")]
    assert terminal == ["failed"] and names[-1] == "failed", (names, log.read_text()[-3000:])
    # Not ready while the group is down (or the port is closed while rank 0 restarts).
    status = None
    with contextlib.suppress(OSError):
        status = get(f"{base}/ready")[0]
    assert status != 200
    # The agent restarts the group; the daemon is ready again, with a new rank 1.
    wait_ready(base, proc)
    print(
        f"rank 1 killed: request failed after {failed_after:.2f} s, ready again after "
        f"{time.monotonic() - killed_at:.1f} s"
    )
    assert rank_pid(proc.pid, 1) not in (None, follower)
    # The first start warmed up; the heal of a group that had served did not (nothing it would warm was lost).
    text = log.read_text()
    assert "warm-up took" in text and "warm-up skipped: a heal of a group that served before" in text, text[-3000:]
    events = list(
        stream(base, {"prompt": "after the restart", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 2})
    )
    assert events[-1][0] == "completed", events[-1]
    # Nor did it read the checkpoint's denoiser again: every rank mapped what the first attempt kept in /dev/shm.
    # Counted after a request both ranks served: rank 0 can be ready before rank 1 has logged its line (a CI run
    # read the log between the two).
    text = log.read_text()
    mapped = text.count("weights mapped from what the group's previous attempt kept")
    assert mapped == (2 if kept else 0) and ("kept this rank's weights" in text) == kept, text[-3000:]


def test_sigterm_ends_every_process_within_the_drain_deadline(daemon):
    proc, base, log = daemon
    ranks = [rank_pid(proc.pid, r) for r in (0, 1)]
    assert all(ranks), ranks
    # A request that cannot finish within the 5 s drain deadline is in flight when SIGTERM arrives.
    names: list[str] = []
    reached = threading.Event()

    def client():
        body = {"prompt": "long", "width": 256, "height": 256, "num_inference_steps": 1000, "guidance_scale": 5.0}
        for name, data in stream(base, body, timeout=60):
            names.append(name)
            if name == "progress" and data["step"] >= 2:
                reached.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert reached.wait(30), log.read_text()[-3000:]
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=5 + 20)  # the drain deadline plus a margin for the handlers' last writes and the agent
    elapsed = time.monotonic() - t0
    thread.join(10)
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], pid
    print(f"SIGTERM to exit with a request in flight: {elapsed:.1f} s, exit code {proc.returncode}")
    assert proc.returncode == 0, log.read_text()[-3000:]
    # The request in flight got its one terminal event: cancelled at the deadline.
    assert names and names[-1] == "cancelled", names[-5:]
    assert elapsed >= 4.5
    # The launcher removed the weights its ranks kept in shared memory.
    assert not list(Path("/dev/shm").glob(f"diffusiond-weights-{proc.pid}-*"))
    assert "kept this rank's weights" in log.read_text()


def test_torchrun_launches_the_same_workers(tiny_sd3, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    with open(tmp_path / "torchrun.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                "-m",
                "diffusiond",
                "serve",
                "--model",
                tiny_sd3,
                "--port",
                str(port),
                "--ulysses",
                "2",
                "--drain-timeout",
                "2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc)
            events = list(
                stream(base, {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 3, "seed": 1})
            )
            assert events[-1][0] == "completed", events[-1]
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        finally:
            kill_tree(proc)


def test_ranks_stop_when_the_agent_is_killed(daemon):
    proc, _, log = daemon
    ranks = [rank_pid(proc.pid, r) for r in (0, 1)]
    assert all(ranks), ranks
    os.kill(proc.pid, signal.SIGKILL)  # no chance to stop its workers: they are in sessions of their own
    proc.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in ranks):
        time.sleep(0.2)
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # don't leak them into later tests, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not alive, log.read_text()[-3000:]


def test_rank_local_faults_fail_alone_or_restart_the_group(faulty_daemon):
    """A fault on rank 1 only. In prepare (no collectives): the ranks agree to drop that request, which fails alone
    while the others go on. In denoise (collectives): fatal to the group, every request in flight ends with one
    terminal event within seconds, and the agent brings the group back."""
    proc, base, log = faulty_daemon
    follower = rank_pid(proc.pid, 1)
    cfg = {"width": 64, "height": 64, "guidance_scale": 5.0}

    # prepare: only the culprit fails
    survivor = Client(base, {"prompt": "a long one", "num_inference_steps": 60, "seed": 1, **cfg})
    survivor.start()
    assert survivor.progress.wait(30), log.read_text()[-3000:]
    t0 = time.monotonic()
    culprit = list(stream(base, {"prompt": "fault:prepare", "num_inference_steps": 4, "seed": 2, **cfg}))
    print(f"prepare fault on rank 1: the culprit's terminal event after {time.monotonic() - t0:.2f} s")
    assert terminal_events([n for n, _ in culprit]) == ["failed"] and culprit[-1][0] == "failed", culprit
    assert "rank 1" in culprit[-1][1]["error"] and "injected" not in culprit[-1][1]["error"], culprit[-1]
    survivor.join(60)
    assert terminal_events(survivor.names) == ["completed"], (survivor.names[-3:], log.read_text()[-3000:])
    assert get(f"{base}/ready")[0] == 200 and rank_pid(proc.pid, 1) == follower, "the group must not restart"

    # denoise: the group fails as a whole
    victims = [Client(base, {"prompt": f"long {i}", "num_inference_steps": 1000, "seed": i, **cfg}) for i in (3, 4)]
    for victim in victims:
        victim.start()
    assert all(v.progress.wait(30) for v in victims), log.read_text()[-3000:]
    t0 = time.monotonic()
    culprit = list(stream(base, {"prompt": "fault:denoise", "num_inference_steps": 4, "seed": 5, **cfg}))
    for victim in victims:
        victim.join(30)
    ended = max(v.ended_at or float("inf") for v in victims) - t0
    print(f"denoise fault on rank 1: every request ended {ended:.2f} s after the culprit was sent")
    for names in [[n for n, _ in culprit], *(v.names for v in victims)]:
        assert terminal_events(names) == ["failed"] and names[-1] == "failed", (names[-3:], log.read_text()[-3000:])
    assert "rank 1 failed while denoising" in victims[0].last["error"], victims[0].last
    assert ended < 10
    status = None
    with contextlib.suppress(OSError):
        status = get(f"{base}/ready")[0]
    assert status != 200
    wait_ready(base, proc)
    print(f"denoise fault on rank 1: ready again {time.monotonic() - t0:.1f} s after the fault")
    assert rank_pid(proc.pid, 1) not in (None, follower)
    events = list(stream(base, {"prompt": "after the restart", "num_inference_steps": 2, "seed": 6, **cfg}))
    assert events[-1][0] == "completed", events[-1]


def queued_requests_outlive_a_heal(proc, base, log) -> None:
    """A follower dies while one request runs and three wait behind it (--max-batch 1): the running one fails (one
    terminal event), and the waiting ones are served after the heal on their own connections, each with one answer:
    a native stream goes on under the id it was told (`queued` again, then the rest), an OpenAI request answers 200,
    an OpenAI stream completes. Without the hand-over (daemon/handover.py) they end 503 / `failed` with `retry`."""
    follower = rank_pid(proc.pid, 1)
    assert follower is not None
    small = {"width": 64, "height": 64, "num_inference_steps": 2, "guidance_scale": 5.0}
    outcomes: dict[str, object] = {}

    native_events: list = []

    def native() -> None:
        for event in stream(base, {"prompt": "a blue box", "seed": 3, **small}, timeout=120):
            native_events.append(event)
        outcomes["native"] = native_events

    def openai(streamed: bool) -> None:
        body = {"prompt": "a green square", "size": "64x64", "seed": 4, "num_inference_steps": 2, "stream": streamed}
        req = urllib.request.Request(
            f"{base}/v1/images/generations",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                outcomes["openai-stream" if streamed else "openai"] = (resp.status, resp.read())
        except urllib.error.HTTPError as exc:
            outcomes["openai-stream" if streamed else "openai"] = (exc.code, exc.read())

    long = stream(base, {"prompt": "a long one", "seed": 9, **small, "num_inference_steps": 1000}, timeout=60)
    names = []
    waiting = [threading.Thread(target=native), *(threading.Thread(target=openai, args=(s,)) for s in (False, True))]
    for name, data in long:
        names.append(name)
        if name == "progress" and data["step"] == 2:
            for t in waiting:
                t.start()
            deadline = time.monotonic() + 10
            # Queued, and the native stream's head read by its client (else it is carried as not started: a CI
            # run killed the follower between the two, and the stream was served anew, `queued` once).
            while metric(base, "diffusiond_requests_waiting") < 3 or not native_events:
                assert time.monotonic() < deadline, "the three requests never queued"
                time.sleep(0.05)
            os.kill(follower, signal.SIGKILL)
    assert terminal_events(names) == ["failed"] and names[-1] == "failed", names
    for t in waiting:
        t.join(150)
    tail = log.read_text()[-3000:]
    events = outcomes.get("native")
    assert events and events[-1][0] == "completed", (events, tail)
    assert [n for n, _ in events].count("queued") == 2, events  # once from each rank 0
    assert len({d["id"] for _, d in events}) == 1, events  # the id it was told first
    status, body = outcomes["openai"]
    assert status == 200 and json.loads(body)["data"][0]["b64_json"], (status, body[:300], tail)
    status, body = outcomes["openai-stream"]
    assert status == 200 and b"event: image_generation.completed" in body and b"event: error" not in body, (
        status,
        body[-300:],
        tail,
    )
    wait_ready(base, proc)
    assert metric(base, "diffusiond_requests_carried_over_total") == 3


def metric(base: str, name: str) -> float:
    return samples(get(f"{base}/metrics")[1].decode())[name]


def a_heal_refuses_no_connection(proc, base, log) -> None:
    """A follower killed while idle: /ready stops answering 200 within 2 s; 20 clients that connect during the heal
    get no refused connection, and each is served once the group is back, at its first attempt (those the dying
    rank 0 took are carried over, daemon/handover.py). Before: the listening socket closed with rank 0 for the heal,
    and every client got connection refused; then, requests the dying group took ended `failed` with `retry`."""
    follower = rank_pid(proc.pid, 1)
    assert follower is not None
    os.kill(follower, signal.SIGKILL)
    killed_at = time.monotonic()
    # Not ready, as a balancer's probe (1 s timeout) sees it: 503 from the failing rank 0, then from the launcher
    # until the next rank 0 answers (before: no answer at all, a timeout, for the whole heal).
    noticed = None
    while time.monotonic() - killed_at < 5:
        try:
            status = get(f"{base}/ready", timeout=1.0)[0]
        except OSError:
            status = None
        if status != 200:
            noticed = time.monotonic() - killed_at
            break
        time.sleep(0.05)
    assert noticed is not None and noticed < 2.0 and status == 503, (noticed, status, log.read_text()[-2000:])
    outcomes: list[tuple[str, int]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        body = {"prompt": "during the heal", "width": 64, "height": 64, "num_inference_steps": 2, "seed": i}
        for attempt in range(5):
            try:
                events = list(stream(base, body, timeout=120))
            except ConnectionRefusedError:
                outcome = "refused"
            except OSError as exc:  # urllib wraps it
                outcome = "refused" if isinstance(exc.__cause__ or exc.args[0], ConnectionRefusedError) else repr(exc)
            else:
                last = events[-1] if events else ("none", {})
                if last[0] == "failed" and last[1].get("retry"):
                    time.sleep(1)  # what Retry-After asks
                    continue
                outcome = last[0]
            with lock:
                outcomes.append((outcome, attempt))
            return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    probes = []  # every /ready during the heal gets an answer: 503 until the group is back
    while any(t.is_alive() for t in threads) and (not probes or probes[-1] != 200):
        try:
            probes.append(get(f"{base}/ready", timeout=1.0)[0])
        except OSError as exc:
            probes.append(repr(exc))
        time.sleep(0.2)
    for t in threads:
        t.join(180)
    assert outcomes == [("completed", 0)] * 20, (outcomes, log.read_text()[-3000:])
    assert set(probes) <= {503, 200}, probes
    wait_ready(base, proc)
    assert rank_pid(proc.pid, 1) not in (None, follower)
    print(f"noticed in {noticed:.2f} s; 20 clients during the heal: {outcomes}")
