"""`diffusiond bench cache`: a step cache's speed-up as users see it, side by side in one run.

Two daemons serve the same checkpoint with the same settings (scheduler, threads), one without a step cache and
one with the configuration measured; both start before anything is timed and stay up. Each round sends the same
requests (prompt, seed, steps, size) to each daemon in turn, whole requests over HTTP (the OpenAI Images API: prompt
encoding, denoising, decoding, PNG), `--concurrency` at a time, the one that goes first alternating from round to
round; a round's speed-up is the uncached daemon's wall time over the cached one's. Printed: the median speed-up
over the rounds with its spread (min-max), images/s of each side, the share of request-steps that reused (the
daemon's own counters), and the agreement of the cached images with the uncached ones (PSNR, mean and worst; SSIM).
Each daemon runs one unmeasured round first (a daemon that sat idle is cold). The result cache is off on both
(`--result-cache-bytes` 0, the default), so a repeated request is computed again.

    diffusiond bench cache --configs x0cache:0.2                                         # the bundled model as shipped
    diffusiond bench cache --configs 'dbcache:0.4:{"warmup": 4, "taylorseer": true}' \\
        --scheduler-config '{"stochastic_sampling": false}'                               # sampled deterministically

A configuration is METHOD:THRESHOLD, optionally :JSON (its `--cache-config`). Several configurations run one after
another, each against an uncached daemon of its own. Prompts: captions of the bundled model's kind (a coloured shape,
its place, a background), or "a photo number i" for another checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np

from diffusiond.bench.compare import Daemon


class Side(msgspec.Struct):
    seconds: list[float]  # wall time of each measured round
    reused: float  # share of request-steps that reused, over the measured rounds


class CacheReport(msgspec.Struct):
    config: str
    model: str
    requests: int
    concurrency: int
    steps: int
    rounds: int
    uncached: Side
    cached: Side
    speedups: list[float]  # per round: uncached seconds / cached seconds
    psnr_mean: float
    psnr_min: float
    ssim_mean: float

    @property
    def speedup(self) -> float:
        return statistics.median(self.speedups)


def parse_config(text: str) -> tuple[str, float, dict]:
    """`dbcache:0.4:{"warmup": 4}` -> ("dbcache", 0.4, {"warmup": 4})."""
    method, _, rest = text.partition(":")
    threshold, _, config = rest.partition(":")
    if not method or not threshold:
        raise SystemExit(f"--configs: {text!r} is not METHOD:THRESHOLD[:JSON]")
    return method, float(threshold), json.loads(config) if config else {}


COLOURS = ("red", "green", "blue", "yellow", "white", "black")
SHAPES = ("circle", "square", "triangle")
PLACES = ("at the top left", "in the middle", "at the bottom right", "at the top", "on the left")


def prompts(model: str | None, n: int) -> list[str]:
    """The bundled model's kind of caption (a shape, its colour and place, a background), varied; "a photo number
    i" for another checkpoint."""
    if model is not None:
        return [f"a photo number {i}" for i in range(n)]
    out = []
    for i in range(n):
        colour, shape, place = COLOURS[i % 6], SHAPES[(i // 6) % 3], PLACES[(i // 2) % 5]
        out.append(f"a {colour} {shape} {place} on a {COLOURS[(i + 3) % 6]} background")
    return out


def _counter(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{name}_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _round(base_url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[np.ndarray]]:
    """Wall time of every body sent, `concurrency` at a time, and the images (float RGB in [0, 1]) in order."""
    import aiohttp
    from PIL import Image

    images: list[np.ndarray | None] = [None] * len(bodies)
    queue = list(enumerate(bodies))
    timeout = aiohttp.ClientTimeout(total=3600)

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            while queue:
                i, body = queue.pop(0)
                async with session.post(base_url + "/v1/images/generations", json=body) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"{base_url}: {resp.status} {data}")
                png = base64.b64decode(data["data"][0]["b64_json"])
                images[i] = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64) / 255

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, [i for i in images if i is not None]


def _serve_args(args: argparse.Namespace) -> list[str]:
    extra = list(args.serve_arg or [])
    if args.scheduler_config:
        extra += ["--scheduler-config", args.scheduler_config]
    return extra


def measure(args: argparse.Namespace, config: str, log_dir: Path) -> CacheReport:
    from diffusiond.bench.quality import psnr, ssim

    method, threshold, settings = parse_config(config)
    model = args.model
    if model is None:
        from diffusiond.models.default import default_model

        model = default_model()
    common = _serve_args(args)
    cache = ["--cache", method, "--cache-threshold", str(threshold)]
    if settings:
        cache += ["--cache-config", json.dumps(settings)]
    daemons = {
        "uncached": Daemon(model, args.threads, log_dir / "uncached.log", common),
        "cached": Daemon(model, args.threads, log_dir / "cached.log", common + cache),
    }
    try:
        for daemon in daemons.values():
            daemon.wait_ready()
        width, height = args.size
        bodies = [
            {"prompt": p, "seed": 1000 + i, "num_inference_steps": args.steps, "size": f"{width}x{height}"}
            | ({"guidance_scale": args.guidance_scale} if args.guidance_scale is not None else {})
            for i, p in enumerate(prompts(args.model, args.requests))
        ]
        for daemon in daemons.values():  # warm-up: one unmeasured round each
            asyncio.run(_round(daemon.base_url, bodies, args.concurrency))
        seconds: dict[str, list[float]] = {"uncached": [], "cached": []}
        counters = {
            name: (_counter(d.base_url, "diffusiond_step_cache_reused"), _counter(d.base_url, "diffusiond_steps"))
            for name, d in daemons.items()
        }
        images: dict[str, list[np.ndarray]] = {}
        for r in range(args.rounds):
            order = ["uncached", "cached"] if r % 2 == 0 else ["cached", "uncached"]
            for name in order:
                took, got = asyncio.run(_round(daemons[name].base_url, bodies, args.concurrency))
                seconds[name].append(took)
                images.setdefault(name, got)
            print(f"round {r + 1}: uncached {seconds['uncached'][-1]:.2f} s, cached {seconds['cached'][-1]:.2f} s")
        reused = {}
        for name, d in daemons.items():
            r0, s0 = counters[name]
            steps = _counter(d.base_url, "diffusiond_steps") - s0
            reused[name] = (_counter(d.base_url, "diffusiond_step_cache_reused") - r0) / steps if steps else 0.0
    finally:
        for daemon in daemons.values():
            daemon.stop()
    pairs = list(zip(images["uncached"], images["cached"], strict=True))
    quality = [psnr(a, b) for a, b in pairs]
    return CacheReport(
        config=config,
        model=model,
        requests=args.requests,
        concurrency=args.concurrency,
        steps=args.steps,
        rounds=args.rounds,
        uncached=Side(seconds["uncached"], reused["uncached"]),
        cached=Side(seconds["cached"], reused["cached"]),
        speedups=[u / c for u, c in zip(seconds["uncached"], seconds["cached"], strict=True)],
        psnr_mean=float(np.mean([min(q, 100.0) for q in quality])),
        psnr_min=float(min(quality)),
        ssim_mean=float(np.mean([ssim(a, b) for a, b in pairs])),
    )


def print_report(r: CacheReport) -> None:
    n = r.requests
    ups = r.speedups
    print(
        f"{r.config}: {r.speedup:.2f}x median over {r.rounds} rounds (spread {min(ups):.2f}-{max(ups):.2f}x; "
        f"rounds {', '.join(f'{u:.2f}x' for u in ups)})"
    )
    for name, side in (("uncached", r.uncached), ("cached", r.cached)):
        rate = n / statistics.median(side.seconds)
        print(f"  {name:9s} {rate:6.2f} img/s (median round {statistics.median(side.seconds):.2f} s), "
              f"{100 * side.reused:.0f}% of request-steps reused")  # fmt: skip
    print(f"  agreement with the uncached images: PSNR {r.psnr_mean:.1f} dB mean, {r.psnr_min:.1f} dB worst; "
          f"SSIM {r.ssim_mean:.4f}")  # fmt: skip


def add_args(parser: argparse.ArgumentParser) -> None:
    from diffusiond.daemon.cli import parse_size

    parser.add_argument("--model", help="checkpoint folder (default: the bundled default model)")
    parser.add_argument("--configs", nargs="+", required=True, metavar="METHOD:THRESHOLD[:JSON]")
    parser.add_argument("--size", type=parse_size, default=None, help="WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=None, help="(default: the model's)")
    parser.add_argument("--requests", type=int, default=16, help="requests per round and side (default: 16)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each daemon (default: 2)")
    parser.add_argument("--scheduler-config", help="the same --scheduler-config for both daemons")
    parser.add_argument("--serve-arg", action="append", metavar="ARG", help="extra flag for both daemons")
    parser.add_argument("--json", metavar="OUT", help="write the reports as JSON")


def bench_cache(args: argparse.Namespace) -> int:
    if args.size is None:
        args.size = (64, 64) if args.model is None else (256, 256)
    reports = []
    with tempfile.TemporaryDirectory(prefix="diffusiond-bench-cache-") as tmp:
        for config in args.configs:
            report = measure(args, config, Path(tmp))
            print_report(report)
            reports.append(report)
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(reports))
    return 0
