"""Step caching, side by side in one process and one run: for each method and threshold, the same requests (same
checkpoint, prompts and seeds) through the engine, 8 at a time (continuous batching), against threshold 0 (exact).
Reports the speed-up, the agreement with the exact images (PSNR, SSIM, and the judge's accuracy for the bundled
model) and the share of request-steps that reused their cache.

    python -m diffusiond.tools.cache [--model DIR] [--steps N] [--requests 32]
        [--methods fbcache,dbcache,dbcache+taylorseer,teacache,x0cache] [--thresholds 0.05,0.1,0.2]
        [--teacache-thresholds 0.1,0.2,0.4]
        [--cache-config JSON] [--scheduler-config JSON]

`--cache-config` is dbcache's or x0cache's (as `serve --cache-config`); a method `dbcache+taylorseer` (or
`+taylorseer2`) is dbcache with `"taylorseer": true` (and that order) added to it, so that both run side by side.
`--scheduler-config` changes the checkpoint's scheduler at load (as `serve`'s: '{"stochastic_sampling": false}'
samples the bundled model deterministically).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from diffusiond.bench.quality import psnr, ssim


def count_reuse() -> dict[str, int]:
    """Wrap `stepcache.reuse` (in this process) to count decisions; the returned counts move as requests run."""
    from diffusiond.models.stepcache import methods as stepcache

    counts = {"reused": 0, "decided": 0}
    original = stepcache.reuse

    def counting(state, change):
        decision = original(state, change)
        counts["reused"] += decision
        counts["decided"] += 1
        return decision

    stepcache.reuse = counting
    return counts


async def run(engine, requests) -> tuple[list[np.ndarray], float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.add_request(p).result() for p in requests))
    return [r.image for r in results], time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    import msgspec
    import torch

    from diffusiond.engine.engine import Engine
    from diffusiond.models.default import default_model
    from diffusiond.models.loading.loader import load_adapter
    from diffusiond.models.params import SamplingParams

    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    bundled = args.model is None
    counts = count_reuse()

    adapters = []

    def settings(method: str) -> dict | None:
        name, _, extra = method.partition("+")
        config = json.loads(args.cache_config) if name in ("dbcache", "x0cache") and args.cache_config else {}
        if extra:  # taylorseer or taylorseerN
            config |= {"taylorseer": True, "taylorseer_order": int(extra.removeprefix("taylorseer") or 1)}
        return config or None

    def load():
        adapter = load_adapter(model, scheduler_config=json.loads(args.scheduler_config or "{}"))
        adapter.enable_step_cache(args.methods[0].partition("+")[0], 0.0, settings(args.methods[0]))
        adapters.append(adapter)
        return adapter

    engine = Engine(load, max_batch=8, batch_wait=0.05)
    await engine.start()
    if bundled:
        from diffusiond.tools.demo import scenes as sc
        from diffusiond.tools.demo.judge import judge

        scenes = sc.split()[1][: args.requests]
        prompts = [s.caption for s in scenes]
    else:
        prompts = [f"a photo number {i}" for i in range(args.requests)]
    base = {} if bundled else {"width": args.size, "height": args.size}  # the family's default guidance
    if args.frames:
        base["num_frames"] = args.frames

    def requests(threshold: float) -> list:
        return [
            SamplingParams(prompt=p, seed=1000 + i, num_inference_steps=args.steps, cache_threshold=threshold, **base)
            for i, p in enumerate(prompts)
        ]

    await run(engine, requests(0.0)[:8])  # warm
    rows = []
    exact, exact_time = None, None
    runs = [(args.methods[0], 0.0)]
    for method in args.methods:
        thresholds = args.teacache_thresholds if method == "teacache" else args.thresholds
        runs += [(method, t) for t in thresholds]
    for method, threshold in runs:
        # Between runs, with no request in flight: Python attributes only, no torch work off the step thread.
        adapters[0].enable_step_cache(method.partition("+")[0], 0.0, settings(method))
        times = []
        for _ in range(args.repeats):
            counts.update(reused=0, decided=0)
            images, seconds = await run(engine, requests(threshold))
            times.append(seconds)
        seconds = min(times)
        if exact is None:
            exact, exact_time = images, seconds
        row = {
            "method": (method.partition("+")[0] + f" {json.dumps(settings(method))}" if settings(method) else method)
            if threshold > 0
            else "exact",
            "threshold": threshold,
            "seconds": round(seconds, 3),
            "speedup": round(exact_time / seconds, 3),
            "psnr_db": round(float(np.mean([min(psnr(a, b), 99.0) for a, b in zip(images, exact, strict=True)])), 2),
            "ssim": round(float(np.mean([ssim(a, b) for a, b in zip(images, exact, strict=True)])), 4),
            "reused": round(counts["reused"] / max(1, counts["decided"]), 3),
        }
        if bundled:
            row["judge_all"] = round(
                float(np.mean([judge(s, img).all for s, img in zip(scenes, images, strict=True)])), 3
            )
        rows.append(row)
        print(msgspec.json.encode(row).decode(), flush=True)
    await engine.stop()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint (default: the bundled model)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--size", type=int, default=256, help="side, for checkpoints other than the bundled one")
    parser.add_argument("--frames", type=int, help="video checkpoints: frames per clip (default: the model's)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    floats = lambda s: [float(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--methods", type=lambda s: s.split(","), default=["fbcache", "teacache"])
    parser.add_argument("--thresholds", type=floats, default=[0.05, 0.1, 0.2, 0.4], help="fbcache's and dbcache's")
    parser.add_argument("--teacache-thresholds", type=floats, default=[0.1, 0.2, 0.4, 0.8], help="teacache's")
    parser.add_argument("--cache-config", metavar="JSON", help="dbcache's or x0cache's, e.g. '{\"fn\": 1, \"bn\": 1}'")
    parser.add_argument("--scheduler-config", metavar="JSON", help="scheduler settings changed at load")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
