"""Every parallel strategy against one rank, side by side in one run on the same cores: per-step time (the median
transformer forward of rank 0), the transformer's weight bytes per rank, peak resident memory per rank, and the
wall time of the whole set of requests. One rank runs with all the threads; N ranks with threads / N each.

    python -m diffusiond.bench.strategies [--model DIR] [--size 64x64] [--steps 8] [--requests 4] [--threads 2]

On 2 CPU cores this measures what the strategies cost in communication and what they save in memory, not speed-ups
(the ranks share the cores one rank had); on GPUs each rank has a device of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 rank": (1, []),
    "cfg-parallel 2": (2, ["--cfg-parallel", "2"]),
    "ulysses 2": (2, ["--ulysses", "2"]),
    "ring 2": (2, ["--ring", "2"]),
    "tp 2": (2, ["--tp", "2"]),
    "cfg-parallel 2 + shard-weights": (2, ["--cfg-parallel", "2", "--shard-weights"]),
    "cfg-parallel 2 + vae-parallel 2": (2, ["--cfg-parallel", "2", "--vae-parallel", "2"]),
}


class Job(msgspec.Struct):
    model: str
    width: int
    height: int
    steps: int
    requests: int
    flags: list[str]
    out: str
    threads: int


def timed(fn, device, seconds: list[float]):
    """`fn`, each call's seconds appended to `seconds`. On CUDA the device is synchronised before and after: a kernel
    launch returns at once, and `perf_counter` around it alone measures launches, not work."""
    import torch

    cuda = torch.device(device).type == "cuda"

    def call(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        return out

    return call


def _setup(model: str, flags: list[str]):
    """The model setup `diffusiond serve --model MODEL FLAGS` would run, in this rank's group."""
    from diffusiond.daemon.cli import build_parser
    from diffusiond.daemon.config import load_config
    from diffusiond.daemon.startup import model_setup

    config, _ = load_config(vars(build_parser().parse_args(["serve", "--model", model, *flags])), {})
    return model_setup(config)


def worker(job: Job) -> None:
    import asyncio
    import resource

    import torch
    import torch.distributed as dist

    from diffusiond.daemon.ranks import join_group, leave
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.follower import run_follower
    from diffusiond.engine.outputs import Completed
    from diffusiond.kernels.tensor_parallel import param_bytes

    torch.set_num_threads(job.threads)
    rank = join_group(_setup(job.model, job.flags))
    weights = param_bytes(rank.adapter.transformer)
    steps: list[float] = []
    rank.adapter.denoise = timed(rank.adapter.denoise, rank.adapter.device, steps)
    wall = 0.0
    if rank.rank == 0:

        async def drive() -> float:
            engine = Engine(rank.adapter, max_batch=8, comm=rank.comm)
            await engine.start()
            try:
                warm = await engine.add_request(_params(job, 0, steps=4)).result()
                assert isinstance(warm, Completed), warm
                steps.clear()
                t0 = time.perf_counter()
                handles = [engine.add_request(_params(job, i + 1)) for i in range(job.requests)]
                for handle in handles:
                    result = await handle.result()
                    assert isinstance(result, Completed), result
                return time.perf_counter() - t0
            finally:
                await engine.stop()

        wall = asyncio.run(drive())
    else:
        run_follower(rank.adapter, rank.comm)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {"step_ms": 1000 * statistics.median(steps) if steps else None, "weights": weights, "peak_mb": peak_mb}
    if rank.rank == 0:
        report["wall_s"] = wall
    with open(os.path.join(job.out, f"{rank.rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    leave(0)  # see ranks.leave: a normal exit may abort in gloo's threads


def _params(job: Job, seed: int, steps: int | None = None):
    from diffusiond.models.params import SamplingParams

    return SamplingParams(
        prompt=f"a small red circle at the top left on a blue background {seed}",
        seed=seed,
        width=job.width,
        height=job.height,
        num_inference_steps=steps or job.steps,
        guidance_scale=5.0,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(msgspec.json.decode(argv[1], type=Job))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint (default: the bundled default model)")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layouts", help=f"comma-separated, of: {', '.join(LAYOUTS)} (default: all)")
    ns = parser.parse_args(argv)
    from diffusiond.daemon.cli import resolve_model
    from diffusiond.daemon.launch import free_port

    width, height = (int(x) for x in ns.size.split("x"))
    names = [n.strip() for n in ns.layouts.split(",")] if ns.layouts else list(LAYOUTS)
    model = resolve_model(ns.model)
    print(f"model {model}, {width}x{height}, {ns.steps} steps, CFG on, {ns.requests} requests together")
    rows = []
    for name in names:
        nproc, flags = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as out:
            threads = max(1, ns.threads // nproc)
            job = Job(model, width, height, ns.steps, ns.requests, flags, out, threads)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
            cmd += ["--master-port", str(free_port()), "-m", "diffusiond.bench.strategies"]
            cmd += ["--worker", msgspec.json.encode(job).decode()]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            reports = []
            for r in range(nproc):
                with open(os.path.join(out, f"{r}.json")) as f:
                    reports.append(json.load(f))
        rows.append((name, reports))
    base = rows[0][1][0] if rows[0][0] == "1 rank" else None
    header = f"{'layout':34} {'step ms':>8} {'x 1 rank':>8} {'weights MB/rank':>16} {'x':>6} {'peak MB/rank':>13}"
    print(header + f" {'wall s':>7}")
    for name, reports in rows:
        r0 = reports[0]
        weights = max(r["weights"] for r in reports) / 2**20
        peak = max(r["peak_mb"] for r in reports)
        step_ratio = f"{r0['step_ms'] / base['step_ms']:.2f}" if base else "-"
        weight_ratio = f"{max(r['weights'] for r in reports) / base['weights']:.2f}" if base else "-"
        print(
            f"{name:34} {r0['step_ms']:8.1f} {step_ratio:>8} {weights:16.1f} {weight_ratio:>6} {peak:13.0f} "
            f"{r0['wall_s']:7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
