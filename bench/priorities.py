"""`python -m diffusiond.bench.priorities`: what scheduling by class buys, measured side by side in one run on one
checkpoint (issue 34), with daemons it starts itself:

    python -m diffusiond.bench.priorities                        # the bundled model (images)
    python -m diffusiond.bench.priorities --model DIR --flood 8  # DIR: a video model (a flood of /v1/videos jobs)

1. Interactive latency: class-9 requests (small, few steps) one after another, on an idle daemon, then under a flood
   of class-0 work that fills every running slot until the last of them (`--flood` long images on the native route;
   on a video model, `--flood` `/v1/videos` jobs, one more sent as each completes), with preemption (and short steps
   beside a higher class: `--class-window-ms`) and then with neither: p50/p99, the ratio to idle, and the flood's
   steps per second meanwhile.
2. Deadlines: a burst of requests whose clients wait `--patience` seconds each, sent with `deadline_ms` (refused at
   once when they cannot make it) and without (their clients leave; the work done for them is wasted): how many
   finished in time, how many were refused, and the denoising steps spent on requests nobody received.
3. The result cache: a seeded request, then the same again: latencies, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
import numpy as np

from diffusiond.bench.compare import Daemon
from diffusiond.bench.serve import sse_events
from diffusiond.models.families.specs import family_of


class Latencies(msgspec.Struct):
    p50_s: float
    p99_s: float
    n: int
    # Under a flood: the flood's denoising steps per second meanwhile (summed over its requests).
    flood_steps_per_s: float | None = None


class DeadlineRun(msgspec.Struct):
    sent: int
    in_time: int
    refused: int
    late: int
    # Denoising steps run for requests whose client had left (or that finished after it did).
    wasted_steps: int


class PriorityReport(msgspec.Struct):
    model: str
    video: bool
    idle: Latencies
    flood_preemption: Latencies
    flood_no_preemption: Latencies
    preemptions: int
    with_deadlines: DeadlineRun
    without_deadlines: DeadlineRun
    cache_miss_s: float
    cache_hit_s: float


def _latencies(values: list[float]) -> Latencies:
    a = np.asarray(values)
    return Latencies(float(np.percentile(a, 50)), float(np.percentile(a, 99)), len(values))


def _counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def _generate(session: aiohttp.ClientSession, base: str, body: dict, patience: float | None = None):
    """One native request to its end: (seconds, terminal event name or HTTP status, its data)."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(patience):
            async with session.post(f"{base}/v1/generations", json=body) as resp:
                if resp.status != 200:
                    return time.perf_counter() - t0, str(resp.status), await resp.json()
                last = ("truncated", {})
                async for name, data in sse_events(resp):
                    last = (name, data)
                return time.perf_counter() - t0, *last
    except TimeoutError:
        return time.perf_counter() - t0, "gave_up", {}


class Workload:
    def __init__(self, args: argparse.Namespace, video: bool) -> None:
        self.args, self.video = args, video
        self.rng = random.Random(args.seed)
        self.unique = 0

    def interactive(self) -> dict:
        a = self.args
        body = {"prompt": "a small red circle", "priority": 9, "num_inference_steps": a.steps, "preview_every": 0}
        body |= {"width": a.size, "height": a.size, "seed": self.rng.randrange(2**31)}
        return body | ({"num_frames": 1} if self.video else {})

    def flood(self) -> dict:
        a = self.args
        self.unique += 1
        body = {"prompt": f"a long low scene {self.unique}", "priority": 0, "num_inference_steps": a.flood_steps}
        if self.video:
            return body | {"size": f"{a.size}x{a.size}", "num_frames": a.flood_frames}
        side = a.flood_size or a.size
        return body | {"width": side, "height": side, "preview_every": 0}


async def _interactive(session, base: str, work: Workload, n: int) -> Latencies:
    times = []
    for _ in range(n):
        seconds, name, data = await _generate(session, base, work.interactive())
        assert name == "completed", (name, data)
        times.append(seconds)
        await asyncio.sleep(0.05)
    return _latencies(times)


async def _under_flood(session, base: str, work: Workload, n: int) -> Latencies:
    """`n` interactive requests while `--flood` class-0 ones fill the engine (kept at that many until the end)."""
    stop = asyncio.Event()
    jobs: list[str] = []

    async def images() -> None:
        while not stop.is_set():
            _, name, data = await _generate(session, base, work.flood())
            if name != "completed":
                raise RuntimeError(f"a flood request ended {name}: {data}")

    async def videos() -> None:
        """`--flood` jobs in flight until the end: one more for each that completes."""
        pending: list[str] = []
        while not stop.is_set():
            while len(pending) < work.args.flood:
                async with session.post(f"{base}/v1/videos", json=work.flood()) as resp:
                    assert resp.status == 200, await resp.text()
                    pending.append((await resp.json())["id"])
                    jobs.append(pending[-1])
            await asyncio.sleep(0.05)
            for job in list(pending):
                async with session.get(f"{base}/v1/videos/{job}") as resp:
                    status = (await resp.json())["status"]
                if status == "failed":
                    raise RuntimeError(f"a flood job failed: {job}")
                if status == "completed":
                    pending.remove(job)

    flooders = [asyncio.create_task(videos())] if work.video else [asyncio.create_task(images())]
    flooders += [] if work.video else [asyncio.create_task(images()) for _ in range(work.args.flood - 1)]
    try:
        await _until_full(session, base, work.args.max_batch, flooders)
        before = _counter(await (await session.get(f"{base}/metrics")).text(), "diffusiond_steps_total")
        t0 = time.perf_counter()
        found = await _interactive(session, base, work, n)
        seconds = time.perf_counter() - t0
        after = _counter(await (await session.get(f"{base}/metrics")).text(), "diffusiond_steps_total")
        found.flood_steps_per_s = (after - before - n * work.args.steps) / seconds
        return found
    finally:
        stop.set()
        for task in flooders:  # a flood request's connection closes: the daemon cancels it at the next step
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
        for job in jobs:
            async with session.delete(f"{base}/v1/videos/{job}"):
                pass
        await _until_idle(session, base)


async def _gauge(session, base: str, name: str) -> float:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _until_full(session, base: str, slots: int, flooders: list[asyncio.Task]) -> None:
    for _ in range(600):
        for task in flooders:
            if task.done() and task.exception() is not None:
                raise task.exception()
        if await _gauge(session, base, "diffusiond_requests_running") >= slots:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the flood never filled the running slots")


async def _until_idle(session, base: str) -> None:
    for _ in range(1200):
        running = await _gauge(session, base, "diffusiond_requests_running")
        waiting = await _gauge(session, base, "diffusiond_requests_waiting")
        if running == waiting == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the daemon did not go idle")


async def _deadlines(session, base: str, work: Workload, patience: float, tell: bool) -> DeadlineRun:
    """A burst of `--burst` requests whose clients each wait `patience` seconds; with `tell`, they say so."""
    before = _counter(await (await session.get(f"{base}/metrics")).text(), "diffusiond_steps_total")
    bodies = [work.interactive() | {"priority": 0} for _ in range(work.args.burst)]
    if tell:
        bodies = [b | {"deadline_ms": int(patience * 1000)} for b in bodies]
    results = await asyncio.gather(*(_generate(session, base, b, patience) for b in bodies))
    await _until_idle(session, base)
    after = _counter(await (await session.get(f"{base}/metrics")).text(), "diffusiond_steps_total")
    in_time = sum(name == "completed" and seconds <= patience for seconds, name, _ in results)
    refused = sum(name == "429" for _, name, _ in results)
    steps = work.args.steps
    return DeadlineRun(
        sent=len(bodies),
        in_time=in_time,
        refused=refused,
        late=len(bodies) - in_time - refused,
        wasted_steps=int(after - before - in_time * steps),
    )


async def _cache(session, base: str, work: Workload) -> tuple[float, float]:
    misses, hits = [], []
    for _ in range(5):
        body = work.interactive()
        first = await _generate(session, base, body)
        again = await _generate(session, base, body)
        assert first[1] == again[1] == "completed" and again[2].get("cached"), (first[1], again[1])
        misses.append(first[0])
        hits.append(again[0])
    return statistics.median(misses), statistics.median(hits)


def measure(args: argparse.Namespace, log_dir: Path) -> PriorityReport:
    model = args.model
    video = family_of(json.loads((Path(model) / "model_index.json").read_text())["_class_name"]).modality == "video"
    common = ["--max-batch", str(args.max_batch), "--result-cache-bytes", str(64 << 20), "--batch-wait-ms", "0"]
    common += ["--priority-aging-steps", str(args.aging_steps)] if args.aging_steps else []
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    found: dict[str, object] = {}
    window = [] if args.class_window_ms is None else ["--class-window-ms", str(args.class_window_ms)]
    for preemption in (True, False):
        extra = [*common, *window] if preemption else [*common, "--no-preemption", "--class-window-ms", "0"]
        daemon = Daemon(model, args.threads, log_dir / f"daemon-{preemption}.log", extra)
        try:
            daemon.wait_ready()

            async def run(base: str = daemon.base_url, preemption: bool = preemption) -> None:
                work = Workload(args, video)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    if preemption:
                        await _interactive(session, base, work, 2)  # warm: step times measured, prompts seen
                        found["idle"] = await _interactive(session, base, work, args.interactive)
                        found["with"] = await _under_flood(session, base, work, args.interactive)
                        metrics = await (await session.get(f"{base}/metrics")).text()
                        found["preemptions"] = int(_counter(metrics, "diffusiond_preemptions_total"))
                        found["told"] = await _deadlines(session, base, work, args.patience, tell=True)
                        found["untold"] = await _deadlines(session, base, work, args.patience, tell=False)
                        found["cache"] = await _cache(session, base, work)
                    else:
                        await _interactive(session, base, work, 2)
                        found["without"] = await _under_flood(session, base, work, args.interactive)

            asyncio.run(run())
        finally:
            daemon.stop()
    miss, hit = found["cache"]
    return PriorityReport(
        model=model,
        video=video,
        idle=found["idle"],
        flood_preemption=found["with"],
        flood_no_preemption=found["without"],
        preemptions=found["preemptions"],
        with_deadlines=found["told"],
        without_deadlines=found["untold"],
        cache_miss_s=miss,
        cache_hit_s=hit,
    )


def print_report(r: PriorityReport, out=None) -> None:
    out = out or sys.stdout
    kind = "video jobs" if r.video else "images"
    print(f"{r.model}: class-9 requests vs a class-0 flood of {kind}", file=out)
    for name, lat in (
        ("idle", r.idle),
        ("flood, preemption", r.flood_preemption),
        ("flood, no preemption", r.flood_no_preemption),
    ):
        ratio = lat.p99_s / r.idle.p99_s
        flood = "" if lat.flood_steps_per_s is None else f"  (flood: {lat.flood_steps_per_s:.1f} steps/s)"
        print(
            f"  {name:<22} p50 {lat.p50_s * 1e3:8.1f} ms  p99 {lat.p99_s * 1e3:8.1f} ms  {ratio:5.2f}x idle p99{flood}",
            file=out,
        )
    print(f"  pauses under the flood: {r.preemptions}", file=out)
    for name, run in (("with deadline_ms", r.with_deadlines), ("without", r.without_deadlines)):
        print(
            f"  burst of {run.sent}, {name:<16}: {run.in_time} in time, {run.refused} refused, {run.late} late or "
            f"given up; steps wasted {run.wasted_steps}",
            file=out,
        )
    ratio = r.cache_hit_s / r.cache_miss_s
    print(
        f"  result cache: miss {r.cache_miss_s * 1e3:.1f} ms, hit {r.cache_hit_s * 1e3:.1f} ms ({ratio:.3f}x)", file=out
    )


def main(argv: list[str] | None = None) -> int:
    from diffusiond.models.default import default_model

    parser = argparse.ArgumentParser(prog="python -m diffusiond.bench.priorities", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=4, help="running slots (default: 4)")
    parser.add_argument("--size", type=int, default=64, help="interactive requests' side (default: 64)")
    parser.add_argument("--steps", type=int, default=4, help="interactive requests' steps (default: 4)")
    parser.add_argument("--flood", type=int, default=8, help="class-0 requests or jobs in flight (default: 8)")
    parser.add_argument("--flood-size", type=int, help="flood images' side (default: --size)")
    parser.add_argument("--flood-frames", type=int, default=9, help="flood clips' frames (default: 9)")
    parser.add_argument("--flood-steps", type=int, default=40, help="flood requests' steps (default: 40)")
    parser.add_argument("--interactive", type=int, default=20, help="interactive requests per phase (default: 20)")
    parser.add_argument("--burst", type=int, default=12, help="requests in the deadline burst (default: 12)")
    parser.add_argument("--patience", type=float, default=2.0, help="seconds each burst client waits (default: 2)")
    parser.add_argument(
        "--aging-steps",
        type=int,
        help="the daemons' --priority-aging-steps (default: theirs): a flood request that waits this many steps "
        "per class rises into the interactive class and competes with it",
    )
    parser.add_argument(
        "--class-window-ms",
        type=int,
        help="the preempting daemon's --class-window-ms (default: theirs); the one without preemption runs with 0",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON")
    args = parser.parse_args(argv)
    args.model = args.model or default_model()
    with tempfile.TemporaryDirectory() as logs:
        report = measure(args, Path(logs))
    print_report(report)
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
