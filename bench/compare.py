"""`diffusiond bench compare --model DIR`: the daemon over HTTP against a clean diffusers process, side by side.

One command starts a daemon on the checkpoint, runs the diffusers baseline in a child process of its own while the
daemon idles (same checkpoint, seed, size, steps, guidance and thread count; see bench/baseline.py), then drives the
daemon with `bench serve` workloads, and prints the ratios:
- one request at a time: latency over HTTP vs one `pipeline(...)` call (alone, and with the PNG a user would save);
- 8 concurrent requests: images/s vs 8 sequential calls and vs one batched call of 8;
- saturated throughput vs the bare batched transformer forward (the bound);
- time to first preview with 8 in flight, in step times; event-loop lag p99 and broadcast per step (from /metrics).
`--against DIR` (another checkout of diffusiond, e.g. `git worktree add /tmp/before REV`) serves the same model from
that tree too, in the same blocks and rounds (the two daemons take turns going first): its ratios to diffusers
beside this tree's, and this tree's to it. So "no worse than before" is measured side by side, not against a
number measured another day on a machine that drifts.
`--plot OUT.png` draws latency and images/s against concurrency (needs matplotlib: the `plot` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

from diffusiond.bench.baseline import Baseline, Job, median_forward
from diffusiond.bench.serve import Summary, run_load
from diffusiond.daemon.launch import free_port

SWEEP = (1, 2, 4, 8, 16)


def _metrics(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def _histogram(text: str, name: str, labels: str = "") -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, cumulative buckets) of one Prometheus histogram series."""
    sel = re.escape(labels)
    total = float(re.search(rf"^{name}_sum{sel} (\S+)$", text, re.M).group(1))
    count = float(re.search(rf"^{name}_count{sel} (\S+)$", text, re.M).group(1))
    inner = labels[1:-1] + "," if labels else ""
    buckets = [
        (float("inf") if le == "+Inf" else float(le), float(v))
        for le, v in re.findall(rf'^{name}_bucket\{{{re.escape(inner)}le="([^"]+)"\}} (\S+)$', text, re.M)
    ]
    return total, count, buckets


def _quantile(before, after, q: float) -> float:
    """Upper bound of the bucket holding quantile q of the observations between two scrapes."""
    count = after[1] - before[1]
    target = q * count
    for (le, b), (_, a) in zip(before[2], after[2], strict=True):
        if a - b >= target:
            return le
    return float("inf")


class Daemon:
    def __init__(self, model: str, threads: int, log: Path, extra: list[str], source: Path | None = None) -> None:
        """`source`: another checkout of diffusiond to serve from (imported before the installed one)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", model, "--port", str(self.port)]
        cmd += ["--threads", str(threads), "--max-queue", "256", *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
        env["OMP_NUM_THREADS"] = str(threads)
        if source is not None:
            shim = log.parent / f"{log.stem}-path"
            shim.mkdir()
            (shim / "diffusiond").symlink_to(source.resolve(), target_is_directory=True)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
            # Not the working folder on sys.path (-P): run from this checkout's root, its kernels/ would shadow
            # the PyPI `kernels` that transformers imports, and only this checkout's diffusiond takes it off.
            cmd.insert(1, "-P")
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, within: float = 300.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(self.base_url + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the daemon was not ready within {within:g} s")

    def version(self) -> str:
        """The version the daemon reports (its `diffusiond_model` info metric)."""
        match = re.search(r'^diffusiond_model_info\{.*version="([^"]*)"', _metrics(self.base_url), re.M)
        return match.group(1) if match else "unknown"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _load_args(base_url: str, args, **overrides) -> argparse.Namespace:
    values = {
        "base_url": base_url,
        "api_key": None,
        "api": "openai",
        "num_requests": 8,
        "concurrency": 1,
        "request_rate": None,
        "size": args.size,
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "prompt": "a red circle at the top left on a blue background",
        "stream": False,
        "workload": None,
        "slo": None,
        "seed": 0,
        "timeout": 600.0,
        "metrics_url": None,
    }
    return argparse.Namespace(**{**values, **overrides})


def _serve(base_url: str, args, **overrides) -> Summary:
    return asyncio.run(run_load(_load_args(base_url, args, **overrides)))


class Report(msgspec.Struct):
    model: str
    size: str
    steps: int
    guidance_scale: float
    threads: int
    # Alternating blocks, one request at a time, medians per block: diffusers call + PNG, diffusers call alone,
    # diffusiond over HTTP.
    single_s: list[tuple[float, float, float]]
    # Alternating rounds of `images` images: diffusers sequential, diffusers batched (8 per call), diffusiond at
    # concurrency 8, in images/s.
    throughput: list[tuple[float, float, float]]
    forward_bound_images_per_s: float
    sweep: dict[int, Summary]
    ttfp_8_s: float
    step_s: float
    loop_lag_p99_s: float
    broadcast_mean_s: float
    # `--against DIR`: that tree's daemon in the same blocks and rounds (one-request medians; images/s at 8).
    against: str | None = None
    against_version: str | None = None
    against_single_s: list[float] = []
    against_throughput: list[float] = []


def _stage_mean(before: str, after: str, *stages: str) -> float:
    """Seconds per forward of the given stages between two scrapes."""
    total = 0.0
    for stage in stages:
        b, a = (_histogram(t, "diffusiond_stage_seconds", f'{{stage="{stage}"}}') for t in (before, after))
        total += a[0] - b[0]
    b, a = (_histogram(t, "diffusiond_stage_seconds", '{stage="denoise"}') for t in (before, after))
    return total / max(1.0, a[1] - b[1])


def _single_block(url: str, args: argparse.Namespace) -> float:
    """Median latency of `args.block` requests one at a time, after one unmeasured (a daemon that sat idle is
    cold)."""
    _serve(url, args, num_requests=1)
    return statistics.median(_serve(url, args, num_requests=1).latency_s["p50"] for _ in range(args.block))


def _eight_round(url: str, args: argparse.Namespace, images: int) -> float:
    """Images/s of `images` requests 8 at a time, after an unmeasured 8."""
    _serve(url, args, num_requests=8, concurrency=8)
    return _serve(url, args, num_requests=images, concurrency=8).images_per_s


def measure(args: argparse.Namespace, log_dir: Path) -> Report:
    images = max(8, args.images - args.images % 8)  # whole batches of 8 on the diffusers side
    extra = args.serve_arg or []
    daemon = Daemon(args.model, args.threads, log_dir / "daemon.log", extra)
    against = (
        None if args.against is None else Daemon(args.model, args.threads, log_dir / "against.log", extra, args.against)
    )
    daemons = [d for d in (daemon, against) if d is not None]
    try:
        for d in daemons:
            d.wait_ready()
        # What is not given comes from the model's own defaults, as the daemon serves them.
        with urllib.request.urlopen(daemon.base_url + "/v1/models", timeout=10) as resp:
            defaults = msgspec.json.decode(resp.read())["data"][0]["diffusiond"]
        args.size = args.size or (defaults["default_width"], defaults["default_height"])
        args.steps = args.steps or defaults["default_steps"]
        if args.guidance_scale is None:
            args.guidance_scale = defaults["default_guidance"]
        (width, height), guidance = args.size, args.guidance_scale
        url = daemon.base_url
        for d in daemons:
            _serve(d.base_url, args, num_requests=3)  # warm-up: allocator, kernels at batch 1
            _serve(d.base_url, args, num_requests=16, concurrency=8)  # ... and at batch 8
        with Baseline(Job(args.model, width, height, args.steps, guidance, args.threads)) as baseline:
            # Blocks, alternating sides; each block starts with one unmeasured request, because a process that sat
            # idle while the other side ran is cold (measured here: a diffusers call takes 274 ms right after 0.5 s
            # idle and 231 ms back to back, and the daemon behaves alike). A plain diffusers loop is warm. Two
            # daemons take turns going first.
            single, against_single = [], []
            for i in range(args.repeats):
                baseline.run("single")
                png = [baseline.run("single") for _ in range(args.block)]
                baseline.run("single_np")
                alone = [baseline.run("single_np") for _ in range(args.block)]
                took = {d: _single_block(d.base_url, args) for d in (daemons if i % 2 == 0 else daemons[::-1])}
                single.append((statistics.median(png), statistics.median(alone), took[daemon]))
                against_single += [took[against]] if against else []
            throughput, against_throughput = [], []
            for i in range(args.rounds):
                baseline.run("sequential 1")
                sequential = 8 / baseline.run("sequential 8")
                baseline.run("batched 8")
                batched = images / baseline.run(f"batched {images}")
                rate = {d: _eight_round(d.base_url, args, images) for d in (daemons if i % 2 == 0 else daemons[::-1])}
                throughput.append((sequential, batched, rate[daemon]))
                against_throughput += [rate[against]] if against else []
            bound = 8 / (median_forward(baseline) * args.steps)
        before = _metrics(url)
        sweep = {c: _serve(url, args, num_requests=max(16, 2 * c), concurrency=c) for c in SWEEP}
        after = _metrics(url)
        # Time to first preview with 8 in flight (native SSE, a preview every step), in step times of that run.
        ttfp = _serve(url, args, num_requests=4 * 8, concurrency=8, api="native", stream=True)
        last = _metrics(url)
        lag = [_histogram(t, "diffusiond_event_loop_lag_seconds") for t in (before, after)]
        bcast = [_histogram(t, "diffusiond_stage_seconds", '{stage="broadcast"}') for t in (before, after)]
        return Report(
            model=args.model,
            size=f"{width}x{height}",
            steps=args.steps,
            guidance_scale=guidance,
            threads=args.threads,
            single_s=single,
            throughput=throughput,
            forward_bound_images_per_s=bound,
            sweep=sweep,
            ttfp_8_s=ttfp.time_to_first_preview_s["p50"] if ttfp.time_to_first_preview_s else float("nan"),
            step_s=_stage_mean(after, last, "denoise", "sampler"),
            loop_lag_p99_s=_quantile(lag[0], lag[1], 0.99),
            broadcast_mean_s=(bcast[1][0] - bcast[0][0]) / max(1, bcast[1][1] - bcast[0][1]),
            against=str(args.against) if against else None,
            against_version=against.version() if against else None,
            against_single_s=against_single,
            against_throughput=against_throughput,
        )
    finally:
        for d in daemons:
            d.stop()


def ratios(r: Report) -> dict[str, float]:
    """Medians of the paired ratios (each pair measured back to back)."""
    med = statistics.median
    return {
        "single_vs_png": med(h / p for p, _, h in r.single_s),
        "single_vs_call": med(h / a for _, a, h in r.single_s),
        "eight_vs_sequential": med(e / s for s, _, e in r.throughput),
        "eight_vs_batched": med(e / b for _, b, e in r.throughput),
        "best_vs_bound": max([s.images_per_s for s in r.sweep.values()] + [e for *_, e in r.throughput])
        / r.forward_bound_images_per_s,
    } | _against_ratios(r)


def _against_ratios(r: Report) -> dict[str, float]:
    """`--against`'s daemon to diffusers, and this tree's to it, paired as measured."""
    if r.against is None:
        return {}
    med = statistics.median
    singles = list(zip(r.single_s, r.against_single_s, strict=True))
    rounds = list(zip(r.throughput, r.against_throughput, strict=True))
    return {
        "against_single_vs_png": med(a / p for (p, _, _), a in singles),
        "single_vs_against": med(h / a for (_, _, h), a in singles),
        "against_eight_vs_batched": med(a / b for (_, b, _), a in rounds),
        "eight_vs_against": med(e / a for (_, _, e), a in rounds),
    }


def print_report(r: Report) -> None:
    med = statistics.median
    q = ratios(r)
    png, alone, http = (med(x[i] for x in r.single_s) for i in range(3))
    seq, batched, eight = (med(x[i] for x in r.throughput) for i in range(3))
    print(f"model {r.model}: {r.size}, {r.steps} steps, guidance {r.guidance_scale:g}, {r.threads} torch threads")
    print(
        f"diffusers in a clean child process, alternated with the daemon: {len(r.single_s)} blocks of single "
        f"requests, {len(r.throughput)} throughput rounds, each after a warm-up; ratios are medians over pairs\n"
    )
    if r.against is not None:
        print(f"--against: {r.against} (diffusiond {r.against_version}), in the same blocks and rounds\n")
    print(f"{'':44s} {'measured':>14s} {'ratio':>8s}")
    rows = [
        ("diffusers, one call + PNG", f"{png * 1e3:.1f} ms", ""),
        ("diffusers, one call alone", f"{alone * 1e3:.1f} ms", ""),
        ("diffusiond, one request over HTTP (PNG)", f"{http * 1e3:.1f} ms", f"{q['single_vs_png']:.3f}x"),
        ("  ... vs the call alone", "", f"{q['single_vs_call']:.3f}x"),
        ("diffusers, sequential calls + PNGs", f"{seq:.2f} img/s", ""),
        ("diffusers, batched calls of 8 + PNGs", f"{batched:.2f} img/s", ""),
        ("diffusiond, 8 concurrent over HTTP", f"{eight:.2f} img/s", ""),
        ("  ... vs sequential calls", "", f"{q['eight_vs_sequential']:.3f}x"),
        ("  ... vs batched calls of 8", "", f"{q['eight_vs_batched']:.3f}x"),
        ("bare batched forward of 8 (bound)", f"{r.forward_bound_images_per_s:.2f} img/s", ""),
        ("diffusiond, best throughput vs the bound", "", f"{q['best_vs_bound']:.3f}x"),
        ("time to first preview, 8 in flight", f"{r.ttfp_8_s * 1e3:.1f} ms", f"{r.ttfp_8_s / r.step_s:.2f} st"),
        ("event-loop lag p99 (histogram bucket)", f"<= {r.loop_lag_p99_s * 1e3:.1f} ms", ""),
        ("plan encode + broadcast + decode per step", f"{r.broadcast_mean_s * 1e6:.0f} us", ""),
    ]
    if r.against is not None:
        rows += [
            ("--against, one request over HTTP (PNG)", f"{med(r.against_single_s) * 1e3:.1f} ms", ""),
            ("  ... vs diffusers, one call + PNG", "", f"{q['against_single_vs_png']:.3f}x"),
            ("  this tree's one request vs --against's", "", f"{q['single_vs_against']:.3f}x"),
            ("--against, 8 concurrent over HTTP", f"{med(r.against_throughput):.2f} img/s", ""),
            ("  ... vs diffusers, batched calls of 8", "", f"{q['against_eight_vs_batched']:.3f}x"),
            ("  this tree's 8 concurrent vs --against's", "", f"{q['eight_vs_against']:.3f}x"),
        ]
    for name, value, ratio in rows:
        print(f"{name:44s} {value:>14s} {ratio:>8s}")
    print(f"\n{'concurrency':>11s} {'img/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for c, s in sorted(r.sweep.items()):
        print(f"{c:11d} {s.images_per_s:8.2f} {s.latency_s['p50'] * 1e3:8.1f} {s.latency_s['p99'] * 1e3:8.1f}")


def plot(r: Report, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'diffusiond[plot]'") from None
    conc = sorted(r.sweep)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(conc, [r.sweep[c].images_per_s for c in conc], "o-", label="diffusiond over HTTP")
    med = statistics.median
    ax1.axhline(med(x[0] for x in r.throughput), color="gray", ls="--", label="diffusers, sequential calls")
    ax1.axhline(med(x[1] for x in r.throughput), color="black", ls=":", label="diffusers, calls of 8")
    ax1.axhline(r.forward_bound_images_per_s, color="red", ls="-.", label="bare batched forward (bound)")
    ax1.set(xlabel="concurrent requests", ylabel="images/s", xscale="log", xticks=conc, xticklabels=conc)
    ax1.legend(fontsize=8)
    ax2.plot(conc, [r.sweep[c].latency_s["p50"] for c in conc], "o-", label="p50")
    ax2.plot(conc, [r.sweep[c].latency_s["p99"] for c in conc], "s--", label="p99")
    ax2.axhline(med(x[0] for x in r.single_s), color="gray", ls="--", label="diffusers, one call + PNG")
    ax2.set(xlabel="concurrent requests", ylabel="latency (s)", xscale="log", xticks=conc, xticklabels=conc)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{Path(r.model).name}: {r.size}, {r.steps} steps, guidance {r.guidance_scale:g}, {r.threads} threads")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def add_args(parser: argparse.ArgumentParser) -> None:
    from diffusiond.daemon.cli import parse_size

    parser.add_argument("--model", help="checkpoint folder (default: the bundled default model)")
    parser.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--steps", type=int, help="(default: the model's)")
    parser.add_argument("--guidance-scale", type=float, help="(default: the model's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default: 2)")
    parser.add_argument("--images", type=int, default=32, help="images per throughput measurement (default: 32)")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds per side (default: 5)")
    parser.add_argument("--repeats", type=int, default=6, help="single-request blocks per side (default: 6)")
    parser.add_argument("--block", type=int, default=4, help="measured requests per block (default: 4)")
    parser.add_argument("--serve-arg", action="append", metavar="ARG", help="extra flag for `diffusiond serve`")
    parser.add_argument(
        "--against",
        type=_source_tree,
        metavar="DIR",
        help="another checkout of diffusiond (git worktree add DIR REV): its daemon measured in the same blocks",
    )
    parser.add_argument("--plot", metavar="OUT.png")
    parser.add_argument("--json", metavar="OUT")


def _source_tree(text: str) -> Path:
    tree = Path(text)
    if not (tree / "daemon" / "cli.py").is_file() or not (tree / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a diffusiond source tree (no daemon/cli.py)")
    return tree


def bench_compare(args: argparse.Namespace) -> int:
    from diffusiond.daemon.cli import resolve_model

    args.model = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(args, Path(tmp))
    print_report(report)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        Path(args.json).write_text(msgspec.json.format(msgspec.json.encode(report)).decode())
    return 0
