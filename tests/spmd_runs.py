"""Running requests through an SPMD group for tests: one rank in the test's process (the reference), or a group of
ranks launched by torch.distributed.run on tests/engine/spmd_worker.py (gloo on CPU).

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from spmd_runs import ...`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.loader import load_adapter

WORKER = Path(__file__).parent / "engine" / "spmd_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_rank(model: str, requests, cache: str | None = None, loras=()) -> list[np.ndarray]:
    async def run():
        adapter = load_adapter(model)
        if cache:
            adapter.enable_step_cache(cache, 0.0)
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
    shard: bool = False,
    vae: int = 1,
    loras=(),
) -> tuple[list[np.ndarray], list[list[dict]]]:
    """The requests through a group of cfg x ulysses x ring x tp ranks (2 unless a layout asks for more)."""
    nproc = cfg * ulysses * ring * tp
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(WORKER),
        model,
        str(out),
        str(cfg),
        str(ulysses),
        msgspec.json.encode(requests).decode(),
        *([cache] if cache else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPMD_RING": str(ring), "SPMD_TP": str(tp)}
    if shard:
        env["SPMD_SHARD"] = "1"
    env["SPMD_VAE"] = str(vae)
    if loras:
        env["SPMD_LORA"] = json.dumps([list(pair) for pair in loras])
    if attention:
        env["SPMD_ATTENTION"] = attention
    if compile:
        env["SPMD_COMPILE"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240 * (nproc // 2), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    images = [np.load(out / f"{i}.npy") for i in range(len(requests))]
    return images, [json.loads((out / f"forwards{r}.json").read_text()) for r in range(nproc)]
