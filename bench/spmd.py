"""`diffusiond bench spmd`: what SPMD costs and what it buys, measured side by side in one run.

1. Plan broadcast: per-step cost of encoding, broadcasting (gloo, 2 ranks) and decoding typical plans, in us.
2. Throughput on the same checkpoint: 1 rank with 2 torch threads, 1 rank with 1 thread, and 2 ranks with
   CFG-parallel at 1 thread each (the same 2 cores), images/s at 8 concurrent requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import msgspec

PROMPT = "a small red circle at the top left on a blue background"


class Args(msgspec.Struct):
    model: str
    width: int
    height: int
    steps: int
    images: int
    plans: int
    out: str


def _requests(args: Args):
    from diffusiond.models.params import SamplingParams

    return [
        SamplingParams(
            prompt=f"{PROMPT} {i}",
            seed=i,
            width=args.width,
            height=args.height,
            num_inference_steps=args.steps,
            guidance_scale=5.0,
        )
        for i in range(args.images)
    ]


async def _throughput(engine, requests, concurrency: int = 8) -> float:
    from diffusiond.engine.outputs import Completed

    await engine.start()
    try:
        warm = await engine.add_request(requests[0]).result()
        assert isinstance(warm, Completed), warm
        sem = asyncio.Semaphore(concurrency)

        async def one(p):
            async with sem:
                result = await engine.add_request(p).result()
                assert isinstance(result, Completed), result

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in requests))
        return len(requests) / (time.perf_counter() - t0)
    finally:
        await engine.stop()


def _typical_plans():
    from diffusiond.engine.wire import NewRequest, PlanKind, StepPlan
    from diffusiond.models.params import SamplingParams

    ids = [f"{i:032x}" for i in range(8)]
    new = NewRequest(
        ids[0],
        SamplingParams(
            prompt=PROMPT,
            negative_prompt="blurry",
            seed=12345,
            width=1024,
            height=1024,
            num_inference_steps=28,
            guidance_scale=7.0,
            preview_every=4,
        ),
    )
    return {
        "advance 8": StepPlan(step=100, advance=ids),
        "1 new + advance 8": StepPlan(step=101, new=[new], advance=ids),
        "drop 1 + advance 7": StepPlan(step=102, advance=ids[1:], drop=ids[:1]),
        "heartbeat": StepPlan(step=-1, kind=PlanKind.HEARTBEAT),
    }


def worker(args: Args) -> None:
    """Runs on every rank under torch.distributed.run."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from diffusiond.daemon.ranks import join_group, leave
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.follower import run_follower
    from diffusiond.engine.wire import decode_plan, encode_plan
    from diffusiond.kernels.layout import ParallelLayout
    from diffusiond.models.loading.setup import ModelSetup

    torch.set_num_threads(1)
    rank = join_group(ModelSetup(model=args.model, layout=ParallelLayout(2, cfg_degree=2)))
    plans = _typical_plans()
    lines = []
    for name, plan in plans.items():
        times = []
        for _ in range(args.plans):
            t0 = time.perf_counter()
            if rank.rank == 0:
                decode_plan(rank.comm.broadcast(encode_plan(plan)))
            else:
                decode_plan(rank.comm.broadcast(None))
            times.append(time.perf_counter() - t0)
        if rank.rank == 0:
            us = np.array(times[10:]) * 1e6
            lines.append(
                f"  {name:22s} {len(encode_plan(plan)):5d} B  mean {us.mean():7.1f} us  "
                f"p50 {np.median(us):7.1f} us  p99 {np.percentile(us, 99):7.1f} us"
            )
    if rank.rank == 0:
        ips = asyncio.run(_throughput(Engine(rank.adapter, max_batch=8, comm=rank.comm), _requests(args)))
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + f"\nTHROUGHPUT {ips}\n")
    else:
        run_follower(rank.adapter, rank.comm)
    dist.destroy_process_group()
    leave(0)  # see ranks.leave: a normal exit may abort in gloo's threads


def _single(args: Args, threads: int) -> float:
    code = (
        "import sys, msgspec, torch; from diffusiond.bench import spmd as b;"
        f"torch.set_num_threads({threads}); a = msgspec.json.decode(sys.argv[1], type=b.Args);"
        "from diffusiond.engine.engine import Engine; from diffusiond.models.loading.loader import load_adapter;"
        "import asyncio; engine = Engine(lambda: load_adapter(a.model), max_batch=8);"
        "print(asyncio.run(b._throughput(engine, b._requests(a))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, msgspec.json.encode(args).decode()],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    return float(out.stdout.strip().splitlines()[-1])


def bench_spmd(ns: argparse.Namespace) -> int:
    from diffusiond.daemon.cli import resolve_model
    from diffusiond.daemon.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        width, height = ns.size
        args = Args(resolve_model(ns.model), width, height, ns.steps, ns.images, ns.plans, os.path.join(tmp, "out"))
        print(
            f"model {args.model}, {width}x{height}, {args.steps} steps, guidance 5 (CFG on), {args.images} images, "
            f"8 concurrent"
        )
        one_2t = _single(args, 2)
        one_1t = _single(args, 1)
        port = free_port()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(port),
                "-m",
                "diffusiond.bench.spmd",
                msgspec.json.encode(args).decode(),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        with open(args.out) as f:
            report = f.read().splitlines()
    two = float(report[-1].split()[1])
    print(f"\nplan encode + gloo broadcast + decode, 2 ranks ({args.plans} rounds each):")
    print("\n".join(report[:-1]))
    print("\nthroughput (images/s):")
    print(f"  1 rank, 2 threads            {one_2t:7.2f}  1.00x")
    print(f"  1 rank, 1 thread             {one_1t:7.2f}  {one_1t / one_2t:.2f}x")
    print(f"  2 ranks CFG-parallel, 1+1    {two:7.2f}  {two / one_2t:.2f}x  ({two / one_1t:.2f}x over 1 thread)")
    return 0


if __name__ == "__main__":
    worker(msgspec.json.decode(sys.argv[1], type=Args))
