"""Running requests through an SPMD group for tests: one rank in the test's process (the reference), or a group of
ranks launched as torchrun would launch them, on tests/engine/spmd_worker.py (gloo on CPU).

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from spmd_runs import ...`.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter

WORKER = Path(__file__).parent / "engine" / "spmd_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every rank of tests/engine/spmd_worker.py imports, imported once in a fork server (the `multiprocessing`
# one): each of the ~100 groups these tests start would otherwise spend 6.5 s of a core importing torch, diffusers and
# transformers in every rank (measured here, `python -X importtime`). The server only imports: it runs no torch op,
# starts no OpenMP team and no thread, so its forks start as clean as a new interpreter (the worker sets its own
# thread count, the variables below are set in the fork before the worker's code runs).
PRELOAD = [
    "torch",
    "torch.distributed",
    "diffusers",
    "transformers",
    "diffusiond.daemon.ranks",
    "diffusiond.engine.engine",
    "diffusiond.engine.follower",
    "diffusiond.kernels.layout",
    "diffusiond.models.loading.loader",
    "diffusiond.models.loading.setup",
    "spmd_preload",  # every family's pipeline and adapter modules, which diffusers and transformers import lazily
]
_forks: multiprocessing.context.ForkServerContext | None = None


def _fork_server() -> multiprocessing.context.ForkServerContext:
    global _forks
    if _forks is None:
        _forks = multiprocessing.get_context("forkserver")
        _forks.set_forkserver_preload(PRELOAD)
        # Python 3.11's fork server imports PRELOAD on its own sys.path, not this process's (it hands the caller's to
        # each child only), and skips what it cannot import without a word: spmd_preload, in this folder, reaches it
        # through PYTHONPATH for its start.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), saved]))
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _forks


def _run_script(argv: list[str], env: dict[str, str], log: str) -> None:
    """In a fork of the fork server: `python argv...` with exactly `env`, its output to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


class _Forked:
    """A forked rank with `subprocess.Popen`'s poll/kill/wait/returncode."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.process = _fork_server().Process(target=_run_script, args=(argv, env, str(log)))
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


def launch(cmd: list[str], nproc: int, env: dict[str, str], out: Path, timeout: float) -> None:
    """`cmd` as `nproc` ranks of one gloo group on this host, with the variables torchrun gives its workers (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT: rank 0's init_process_group hosts the store). Not torchrun itself:
    its elastic agent costs each of these ~100 launches about 1.5 s of start-up, and these tests restart nothing
    (tests/spmd run the daemon under the real launcher). A Python script of this interpreter runs forked from the
    fork server (`PRELOAD`), anything else as a new process. Asserts that every rank exited 0."""
    forked = cmd[0] == sys.executable and cmd[1].endswith(".py")
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        log = open(out / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
        if forked:
            procs.append((_Forked(cmd[1:], rank_env, out / f"rank{rank}.log"), log))
        else:
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env), log))
    deadline = time.monotonic() + timeout
    try:
        # As torchrun: the first rank that fails takes the others down (they would wait on it in a collective).
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc, _ in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc, _ in procs]
    logs = []
    for rank, (_, log) in enumerate(procs):
        log.seek(0)
        logs.append(f"--- rank {rank} (exit {codes[rank]}) ---\n" + log.read()[-3000:])
        log.close()
    assert codes == [0] * nproc, "\n".join(logs)


def enable_cache(adapter, cache: str) -> None:
    """`cache`: a method, or METHOD:JSON with its `--cache-config` (the worker reads it the same way)."""
    name, _, config = cache.partition(":")
    adapter.enable_step_cache(name, 0.0, json.loads(config) if config else None)


# one_rank's results by what decides them (checkpoint, requests, cache, adapters): several tests of a family compare
# their layouts with one rank on the same requests, and the one-rank run is computed once per session.
_ONE_RANK: dict[tuple, tuple[list[np.ndarray], list]] = {}


def one_rank(model: str, requests, cache: str | None = None, loras=(), sounds: list | None = None) -> list[np.ndarray]:
    """The requests' images through one rank in this process (once per session for the same inputs); `sounds`, when
    given, gets each request's sound track (video with sound)."""
    key = (model, msgspec.msgpack.encode(list(requests)), cache, tuple(loras))
    if key not in _ONE_RANK:
        tracks: list = []
        _ONE_RANK[key] = (_one_rank(model, requests, cache, loras, tracks), tracks)
    images, tracks = _ONE_RANK[key]
    if sounds is not None:
        sounds.extend(tracks)
    return list(images)


def _one_rank(model: str, requests, cache: str | None, loras, sounds: list) -> list[np.ndarray]:
    async def run():
        adapter = load_adapter(model)
        if cache:
            enable_cache(adapter, cache)
        if loras:
            registry = adapter.enable_lora(1 << 30)
            for name, path in loras:
                registry.register(name, path)
        engine = Engine(adapter, max_batch=8)
        await engine.start()
        try:
            results = [await h.result() for h in [engine.add_request(p) for p in requests]]
        finally:
            await engine.stop()
        assert all(isinstance(r, Completed) for r in results), results
        sounds.extend(r.audio.samples for r in results if r.audio is not None)
        return [r.image for r in results]

    return asyncio.run(run())


def two_ranks(
    model: str,
    out: Path,
    cfg: int,
    ulysses: int,
    requests,
    cache: str | None = None,
    attention: str | None = None,
    compile: bool = False,
    ring: int = 1,
    tp: int = 1,
    shard: bool | str = False,
    vae: int = 1,
    loras=(),
    kept: Path | None = None,
) -> tuple[list[np.ndarray], list[list[dict]]]:
    """The requests through a group of cfg x ulysses x ring x tp ranks (2 unless a layout asks for more)."""
    nproc = cfg * ulysses * ring * tp
    cmd = [
        sys.executable,
        str(WORKER),
        model,
        str(out),
        str(cfg),
        str(ulysses),
        msgspec.json.encode(requests).decode(),
        *([cache] if cache else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPMD_RING": str(ring), "SPMD_TP": str(tp)}
    if shard:  # True: FSDP over every rank; "RxS": HSDP
        env["SPMD_SHARD"] = shard if isinstance(shard, str) else "1"
    env["SPMD_VAE"] = str(vae)
    if loras:
        env["SPMD_LORA"] = json.dumps([list(pair) for pair in loras])
    if attention:
        env["SPMD_ATTENTION"] = attention
    if compile:
        env["SPMD_COMPILE"] = "1"
    if kept is not None:  # the launcher's shared-memory folder (models/loading/kept_weights.py)
        env["_DIFFUSIOND_KEPT_WEIGHTS"] = str(kept)
    launch(cmd, nproc, env, out, timeout=240 * (nproc // 2))
    images = [np.load(out / f"{i}.npy") for i in range(len(requests))]
    return images, [json.loads((out / f"forwards{r}.json").read_text()) for r in range(nproc)]
