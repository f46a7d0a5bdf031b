"""Acceleration side by side in one run: step caching (both methods), `--compile`, int8 and their combinations, on
the same checkpoint, prompts and seeds, against the exact images.

Each configuration runs in a clean child process of its own (the same thread count; the model loads on the
engine's step thread, as the daemon does; the daemon's warm-up first), so that no configuration inherits another's
compiled code, quantized weights or thread state. The exact configuration runs first and last: the speed-up of each
is against the mean of those two, and their ratio shows the drift of the run. With `--alternations N` the whole
sequence runs N times, the exact configuration between each two (exact, the others, exact, the others, ..., exact):
each configuration's speed-up is the median over its runs of the exact runs just before and after it against it,
so that a machine that drifts over minutes (here: 0.85-1.15 between the first and last exact run) moves a pair, not
the result. Requests go through the engine 8 at a time (continuous batching); each configuration reports the best
of --repeats rounds.

Columns: time per round, speed-up, PSNR and SSIM against the exact images, the share of request-steps that reused
their cache, and for the bundled model the judge's accuracy (all five attributes right; held-out captions).

    python -m diffusiond.tools.accel [--model DIR] [--size 256] [--steps 20] [--requests 16] [--repeats 2]
        [--configs exact,fbcache:0.2,teacache:0.4,compile,int8,compile+teacache:0.4,...] [--scheduler-config JSON]
        [--cache-config JSON] [--alternations 1]

The bundled model samples with fresh noise at every step (`stochastic_sampling`), which leaves the step caches
nothing to reuse: measure them on it with `--scheduler-config '{"stochastic_sampling": false}'`.

A configuration is `+`-joined parts: `exact`, `fbcache:X`, `teacache:X`, `dbcache:X`, `x0cache:X`, `magcache:X`
(their settings as `--cache-config` gives them, or their defaults), `taylorseer` or `taylorseer2` (DBCache's
forecast, of that order), `scm-fast`, `scm-medium`, `scm-slow` (the requests' step mask), `compile`, `int8`,
`int8-dynamic`; e.g. `dbcache:0.4+taylorseer+scm-fast`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_CONFIGS = (
    "exact",
    "fbcache:0.2",
    "teacache:0.2",
    "teacache:0.4",
    "compile",
    "int8",
    "int8-dynamic",
    "compile+teacache:0.4",
    "int8+teacache:0.4",
    "compile+int8",
)


def parse(config: str) -> dict:
    """`compile+int8+teacache:0.4` -> {"compile": True, "quantize": "int8", "cache": "teacache", "threshold": 0.4}."""
    out: dict = {"compile": False, "quantize": "none", "cache": "none", "threshold": 0.0, "cache_config": {}}
    for part in config.split("+"):
        name, _, value = part.partition(":")
        if name == "exact":
            continue
        if name == "compile":
            out["compile"] = True
        elif name in ("int8", "int8-dynamic"):
            out["quantize"] = name
        elif name in ("fbcache", "teacache", "dbcache", "x0cache", "magcache"):
            out["cache"], out["threshold"] = name, float(value)
        elif name.startswith("taylorseer"):
            out["cache_config"] |= {"taylorseer": True, "taylorseer_order": int(name.removeprefix("taylorseer") or 1)}
        elif name in ("scm-fast", "scm-medium", "scm-slow"):
            out["cache_config"]["scm"] = name.removeprefix("scm-")
        else:
            raise SystemExit(f"unknown configuration part {part!r}")
    return out


def workload(model: str | None, n: int, size: int) -> tuple[str, list[str], dict]:
    """(checkpoint, prompts, extra request fields): the bundled model's held-out captions at its defaults, or
    "a photo number i" at size x size, the family's default guidance, for another checkpoint."""
    if model is None:
        from diffusiond.models.default import default_model
        from diffusiond.tools.demo.evaluate import eval_scenes

        return default_model(), [s.caption for s in eval_scenes(n)], {}
    return model, [f"a photo number {i}" for i in range(n)], {"width": size, "height": size}


def worker(args: argparse.Namespace) -> None:
    """One configuration in this (clean) process: writes images, times and the reuse share to --out."""
    import torch

    from diffusiond.daemon.app import warm_up_requests
    from diffusiond.daemon.startup import scheduler_changes
    from diffusiond.engine.engine import Engine
    from diffusiond.models.loading.setup import ModelSetup, build_adapter
    from diffusiond.models.params import SamplingParams
    from diffusiond.tools.cache import count_reuse

    torch.set_num_threads(args.threads)
    config = parse(args.worker)
    model, prompts, extra = workload(args.model, args.requests, args.size)
    counts = count_reuse()

    cache_config = json.loads(args.cache_config or "{}") | config["cache_config"] if config["cache"] != "none" else {}
    setup = ModelSetup(
        model=model,
        quantize=config["quantize"],
        scheduler_config=scheduler_changes(args.scheduler_config),
        cache=config["cache"],
        cache_threshold=config["threshold"],
        cache_config=cache_config,
    )

    def load():  # on the engine's step thread, as the daemon loads
        adapter = build_adapter(setup)
        if config["compile"]:  # not `setup.compile`: no configuration may reuse another's inductor cache
            adapter.enable_compile()
        return adapter

    async def main() -> dict:
        engine = Engine(load, max_batch=8, max_waiting=len(prompts) + 8, batch_wait=0.05)
        await engine.start()
        try:
            t0 = time.perf_counter()
            for group in warm_up_requests(engine.adapter.capabilities, compiled=config["compile"]):
                for handle in [engine.add_request(p) for p in group]:
                    await handle.result()
            warm = time.perf_counter() - t0
            requests = [
                SamplingParams(prompt=p, seed=1000 + i, num_inference_steps=args.steps, **extra)
                for i, p in enumerate(prompts)
            ]
            best, images = float("inf"), []
            for _ in range(args.repeats):
                counts.update(reused=0, decided=0)
                t0 = time.perf_counter()
                results = await asyncio.gather(*(engine.add_request(r).result() for r in requests))
                best = min(best, time.perf_counter() - t0)
                images = [r.image for r in results]
            return {
                "warm_s": warm,
                "seconds": best,
                "images": images,
                "reused": counts["reused"] / max(1, counts["decided"]),
            }
        finally:
            await engine.stop()

    result = asyncio.run(main())
    np.save(args.out + ".npy", np.stack(result.pop("images")))
    Path(args.out + ".json").write_text(json.dumps(result))


def run_config(config: str, args: argparse.Namespace, folder: str) -> tuple[dict, np.ndarray]:
    out = os.path.join(folder, config.replace(":", "_").replace("+", "-"))
    cmd = [sys.executable, "-m", "diffusiond.tools.accel", "--worker", config, "--out", out]
    cmd += ["--steps", str(args.steps), "--requests", str(args.requests), "--repeats", str(args.repeats)]
    cmd += ["--threads", str(args.threads), "--size", str(args.size)]
    if args.model:
        cmd += ["--model", args.model]
    if args.scheduler_config:
        cmd += ["--scheduler-config", args.scheduler_config]
    if args.cache_config:
        cmd += ["--cache-config", args.cache_config]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(out + ".json").read_text()), np.load(out + ".npy")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    parser.add_argument("--size", type=int, default=256, help="side, for checkpoints other than the bundled one")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--alternations", type=int, default=1, help="runs of the whole sequence (default: 1)")
    parser.add_argument("--configs", type=lambda s: s.split(","), default=list(DEFAULT_CONFIGS))
    parser.add_argument(
        "--scheduler-config",
        metavar="JSON",
        help="change settings of the checkpoint's scheduler, as `serve --scheduler-config` does: for the bundled "
        "model's step caches, '{\"stochastic_sampling\": false}'",
    )
    parser.add_argument(
        "--cache-config",
        metavar="JSON",
        help="the cache methods' settings, as `serve --cache-config` (the configurations' own parts added to it)",
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    for config in args.configs:
        parse(config)  # refuse a typo before minutes of work
    from diffusiond.tools.cache import psnr, ssim

    bundled = args.model is None
    if bundled:
        from diffusiond.tools.demo.evaluate import eval_scenes
        from diffusiond.tools.demo.judge import judge

        scenes = eval_scenes(args.requests)
    configs = [c for c in args.configs if c != "exact"]
    with tempfile.TemporaryDirectory() as folder:
        first, exact = run_config("exact", args, folder)
        exacts, runs = [first], {c: [] for c in configs}
        for _ in range(max(1, args.alternations)):
            for c in configs:
                runs[c].append(run_config(c, args, folder))
            exacts.append(run_config("exact", args, folder)[0])
    last = exacts[-1]
    drift = last["seconds"] / first["seconds"]
    print(f"exact: {first['seconds']:.2f} s first, {last['seconds']:.2f} s last (drift {drift:.3f})")
    if len(exacts) > 2:
        print("exact runs: " + ", ".join(f"{e['seconds']:.2f} s" for e in exacts))
    # Each run against the exact runs on either side of it.
    speedups = {
        c: [(exacts[i]["seconds"] + exacts[i + 1]["seconds"]) / 2 / r["seconds"] for i, (r, _) in enumerate(rs)]
        for c, rs in runs.items()
    }
    speedups["exact"] = [(first["seconds"] + last["seconds"]) / 2 / first["seconds"]]
    results = {c: rs[0] for c, rs in runs.items()}
    rows = []
    for config, (result, images) in [("exact", (first, exact)), *results.items()]:
        row = {
            "config": config,
            "warm_up_s": round(result["warm_s"], 1),
            "seconds": round(result["seconds"], 3),
            "speedup": round(float(np.median(speedups[config])), 3),
            "speedups": [round(x, 3) for x in speedups[config]],
            "psnr_db": round(float(np.mean([min(psnr(a, b), 99.0) for a, b in zip(images, exact, strict=True)])), 2),
            "ssim": round(float(np.mean([ssim(a, b) for a, b in zip(images, exact, strict=True)])), 4),
            "reused": round(result["reused"], 3),
        }
        if bundled:
            row["judge_all"] = round(
                float(np.mean([judge(s, im).all for s, im in zip(scenes, images, strict=True)])), 3
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = ["config", "speed-up", "PSNR", "SSIM", "reused", "warm-up"] + (["judge"] if bundled else [])
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        cells = [r["config"], f"{r['speedup']:.2f}x", "exact" if r["psnr_db"] >= 99 else f"{r['psnr_db']:.1f} dB"]
        cells += [f"{r['ssim']:.4f}", f"{r['reused']:.0%}", f"{r['warm_up_s']:.1f} s"]
        cells += [f"{r['judge_all']:.1%}"] if bundled else []
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
