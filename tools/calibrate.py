"""TeaCache's rescaling polynomial fitted for one checkpoint (or MagCache's magnitude ratios measured), written
beside its weights:

    python -m diffusiond.tools.calibrate --model DIR [--method teacache|magcache] [--prompts FILE] [--size WxH]
        [--steps N] [--frames N] [--degree 4] [--out DIR]


TeaCache (models/stepcache/methods.py) estimates how much the residual all transformer blocks add changes from one step
to the next from how much the first block's timestep-modulated input changes, which costs one norm instead of every
block. The two are related by a polynomial that depends on the weights (TeaCache publishes FLUX.1's). Here the
checkpoint's own relation is measured: prompts run through the engine with every step computed (threshold 0), and
for every request-step after its first the pair (relative L1 change of the modulated input, relative L1 change of
the blocks' residual) is recorded; a least-squares polynomial through the pairs is written beside the weights as
`diffusiond_cache.json` (models/stepcache/methods.py `CACHE_FILE`), which the adapter reads when it starts with
`--cache teacache`.

`--method magcache`: the same runs record, for every request-step after its first, the mean over its rows and
tokens of the norm of the blocks' residual over the norm of the previous step's (MagCache's magnitude ratio); their
mean per step is written under "magcache" in the same file (the other method's entry is kept), which `--cache
magcache` reads. Measure with the steps the server will mostly run: other step counts take the nearest step's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from diffusiond.models.stepcache.settings import CACHE_FILE

# Prompts any text-to-image model draws, the bundled one included (its words).
PROMPTS = (
    "a red circle",
    "a blue square on a yellow background",
    "a large green triangle at the top left",
    "a small white ball in the middle on a black background",
    "on a red background, a big yellow box",
    "a tiny black dot at the bottom right on a white background",
    "a blue triangle on the left",
    "a large red square in the center on a green background",
    "a small yellow circle at the top",
    "a green box at the bottom left, blue background",
    "a white triangle on a red background",
    "a black square at the right on a yellow background",
    "a big blue disc",
    "a little green square at the top right",
    "a red triangle at the bottom on a white background",
    "a yellow ball on a blue background",
)


def fit(pairs: list[tuple[float, float]], degree: int) -> tuple[tuple[float, ...], float]:
    """Least-squares polynomial y ~ p(x) through the (input change, output change) pairs: its coefficients (highest
    degree first) and R^2."""
    if len(pairs) <= degree:
        raise ValueError(f"{len(pairs)} pairs cannot fit a polynomial of degree {degree}: run more requests or steps")
    x, y = np.array(pairs, dtype=np.float64).T
    coefficients = np.polyfit(x, y, degree)
    residual = y - np.polyval(coefficients, x)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / total if total > 0 else 1.0
    return tuple(float(c) for c in coefficients), r2


def magnitude_ratios(records: list[tuple[float, float]]) -> list[float]:
    """MagCache's ratio per step: the mean of the (step, ratio) records of each step; 1 at the first step."""
    if not records:
        raise ValueError("no ratios recorded: run requests of 2 steps or more")
    steps = int(max(step for step, _ in records)) + 1
    per_step: list[list[float]] = [[] for _ in range(steps)]
    for step, ratio in records:
        per_step[int(step)].append(ratio)
    return [1.0] + [float(np.mean(r)) if r else 1.0 for r in per_step[1:]]


def record_pairs(
    model: str,
    prompts: list[str],
    *,
    steps: int | None = None,
    size: tuple[int, int] | None = None,
    guidance: float | None = None,
    method: str = "teacache",
    frames: int | None = None,
    **setup: Any,
) -> list[tuple[float, float]]:
    """(input change, output change) for every request-step after the first, every step computed, batched as served
    (magcache: (step, magnitude ratio)). `setup`: fields of the model setup (device, dtype, quantize, offload,
    scheduler_config), as it will be served."""
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.outputs import Completed
    from diffusiond.models.loading.setup import ModelSetup, build_adapter
    from diffusiond.models.params import SamplingParams

    pairs: list[tuple[float, float]] = []
    # (MagCache starts with placeholder ratios: at threshold 0 every step computes whatever they are.)
    placeholder = {"ratios": [1.0]} if method == "magcache" else {}
    model_setup = ModelSetup(model=model, cache=method, cache_threshold=0.0, cache_config=placeholder, **setup)

    def load() -> Any:  # on the engine's step thread, which owns torch
        adapter = build_adapter(model_setup)
        adapter.cache.method.record = pairs
        return adapter

    width, height = size or (None, None)
    requests = [
        SamplingParams(
            prompt=prompt,
            seed=1000 + i,
            width=width,
            height=height,
            num_frames=frames,
            num_inference_steps=steps,
            guidance_scale=guidance,
            cache_threshold=0.0,
        )
        for i, prompt in enumerate(prompts)
    ]

    async def run() -> None:
        engine = Engine(load, max_batch=8, max_waiting=len(requests) + 8)
        await engine.start()
        try:
            results = await asyncio.gather(*(engine.add_request(p).result() for p in requests))
        finally:
            await engine.stop()
        failed = [r for r in results if not isinstance(r, Completed)]
        if failed:
            raise RuntimeError(f"{len(failed)} calibration requests did not complete: {failed[0]}")

    asyncio.run(run())
    return pairs


def calibrate(args: argparse.Namespace) -> int:
    from diffusiond.daemon.cli import resolve_model
    from diffusiond.daemon.startup import scheduler_changes
    from diffusiond.models.loading.setup import ModelSetup, check_kernels, check_setup

    model = resolve_model(args.model)
    try:
        scheduler = scheduler_changes(args.scheduler_config)
        options = dict(device=args.device, dtype=args.dtype, quantize=args.quantize, offload=args.offload)
        setup = ModelSetup(model=model, attention=args.attention, scheduler_config=scheduler, **options)
        check_setup(setup)
        check_kernels(setup)
    except ValueError as exc:
        print(f"diffusiond.tools.calibrate: error: {exc}", file=sys.stderr)
        return 2
    prompts = list(PROMPTS)
    if args.prompts:
        prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    t0 = time.monotonic()
    pairs = record_pairs(
        model,
        prompts,
        steps=args.steps,
        size=args.size,
        frames=args.frames,
        guidance=args.guidance_scale,
        method=args.method,
        attention=args.attention,
        scheduler_config=scheduler,
        **options,
    )
    out = Path(args.out or model) / CACHE_FILE
    result = json.loads(out.read_text()) if out.is_file() else {}
    seconds = time.monotonic() - t0
    if args.method == "magcache":
        ratios = magnitude_ratios(pairs)
        result["magcache"] = {"ratios": [round(r, 5) for r in ratios], "prompts": len(prompts), "steps": len(ratios)}
        report = [
            f"{len(pairs)} ratios from {len(prompts)} prompts in {seconds:.1f} s",
            f"magnitude ratio per step: {', '.join(f'{r:.4f}' for r in ratios)}",
        ]
    else:
        coefficients, r2 = fit(pairs, args.degree)
        result["teacache"] = {
            "coefficients": list(coefficients),
            "degree": args.degree,
            "r2": round(r2, 4),
            "pairs": len(pairs),
            "prompts": len(prompts),
            "steps": args.steps,
            "input_change_range": [round(min(p[0] for p in pairs), 6), round(max(p[0] for p in pairs), 6)],
        }
        report = [
            f"{len(pairs)} pairs from {len(prompts)} prompts in {seconds:.1f} s; R^2 {r2:.3f}",
            f"coefficients (highest degree first): {', '.join(f'{c:.6g}' for c in coefficients)}",
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(report))
    print(f"wrote {out}; serve it with --cache {args.method}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from diffusiond.daemon.cli import add_model_args, configure_threads, parse_size, quiet_libraries

    parser = argparse.ArgumentParser(
        prog="python -m diffusiond.tools.calibrate",
        description="Run prompts with every step computed, record each request-step's (modulated input change, "
        "blocks' residual change) and fit a polynomial; `serve --cache teacache` reads it from "
        "<model>/diffusiond_cache.json.",
    )
    add_model_args(parser)
    parser.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: 16 built-in prompts)")
    parser.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    parser.add_argument("--frames", type=int, help="video checkpoints: frames per clip (default: the model's)")
    parser.add_argument("--guidance-scale", type=float, help="classifier-free guidance (default: the model's)")
    parser.add_argument(
        "--method", choices=["teacache", "magcache"], default="teacache", help="what to measure (default: teacache)"
    )
    parser.add_argument("--degree", type=int, default=4, help="polynomial degree (default: 4, as TeaCache's)")
    parser.add_argument("--out", metavar="DIR", help="folder to write diffusiond_cache.json into (default: --model)")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    quiet_libraries()
    return calibrate(args)


if __name__ == "__main__":
    sys.exit(main())
