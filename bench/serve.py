"""`diffusiond bench serve`: drive a running daemon through its HTTP API and report what its users would see (as
`vllm bench serve` does for vLLM).

    diffusiond bench serve --base-url http://127.0.0.1:8000 --num-requests 64 --concurrency 8 --size 256x256
    diffusiond bench serve --request-rate 2 --num-requests 100 --stream --slo 5 --json out.json
    diffusiond bench serve --workload mix.jsonl        # one request body per line (native or OpenAI fields)

A workload line may also hold `_group` (the name it is reported under; default: its `priority`) and `_api_key` (the
tenant it is sent as, instead of --api-key): a mix of classes and tenants is reported group by group, each with its
latency, time to first preview and SLO attainment.

Requests go to the OpenAI route (`/v1/images/generations`; with --stream, one partial image each), or to the native
SSE route with `--api native` (previews every step with --stream). Time to first preview is measured when streaming.
Refusals (429 while the queue is full, 503 while not ready or draining) are counted as such, not raised. Queue wait
comes from the daemon's own histogram (`/metrics`), before and after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import numpy as np

# Makes prompts unique across all runs of this process.
_UNIQUE = itertools.count()


class Group(msgspec.Struct):
    """One group of a mixed workload (`_group`, or its class)."""

    requests: int
    completed: int
    refused: int
    latency_s: dict[str, float]
    time_to_first_preview_s: dict[str, float] | None
    slo_attainment: float | None


class Summary(msgspec.Struct):
    """What `--json` writes. completed + failed = requests; refused counts the failed ones by status (429/503)."""

    requests: int
    completed: int
    failed: int
    refused: dict[str, int]
    errors: dict[str, int]
    duration_s: float
    images_per_s: float
    latency_s: dict[str, float]
    time_to_first_preview_s: dict[str, float] | None
    queue_wait_mean_s: float | None
    slo_s: float | None
    slo_attainment: float | None
    concurrency: int | None
    request_rate: float | None
    # A --workload's groups by name (`_group`, else "priority P"); None without one.
    groups: dict[str, Group] | None = None


@dataclass
class Outcome:
    ok: bool
    status: int
    latency: float
    first_preview: float | None = None
    images: int = 0
    error: str = ""
    group: str = ""


@dataclass
class Load:
    base_url: str
    api: str
    stream: bool
    bodies: list[dict]
    api_key: str | None = None
    outcomes: list[Outcome] = field(default_factory=list)

    async def one(self, session: aiohttp.ClientSession, body: dict) -> Outcome:
        body = dict(body)
        group = str(body.pop("_group", f"priority {body.get('priority', '-')}"))
        key = body.pop("_api_key", self.api_key)
        outcome = await self._send(session, body, {"Authorization": f"Bearer {key}"} if key else {})
        outcome.group = group
        return outcome

    async def _send(self, session: aiohttp.ClientSession, body: dict, headers: dict[str, str]) -> Outcome:
        route = "/v1/generations" if self.api == "native" else "/v1/images/generations"
        t0 = time.perf_counter()
        first = None
        try:
            async with session.post(self.base_url + route, json=body, headers=headers) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    return Outcome(False, resp.status, time.perf_counter() - t0, error=_error_code(text))
                if not (self.stream or self.api == "native"):
                    data = await resp.json()
                    return Outcome(True, 200, time.perf_counter() - t0, images=len(data["data"]))
                images, failed = 0, ""
                async for name, data in sse_events(resp):
                    if name in ("preview", "image_generation.partial_image") and first is None:
                        first = time.perf_counter() - t0
                    elif name in ("completed", "image_generation.completed"):
                        images += len(data.get("images", [None]))
                    elif name in ("failed", "cancelled", "error"):
                        failed = name
                expected = body.get("n", 1) if self.api == "openai" else 1
                ok = not failed and images == expected
                return Outcome(ok, 200, time.perf_counter() - t0, first, images, failed or ("" if ok else "truncated"))
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Outcome(False, 0, time.perf_counter() - t0, error=type(exc).__name__)


def _error_code(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


async def sse_events(resp: aiohttp.ClientResponse):
    """(event name, data) of a text/event-stream response."""
    name = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, json.loads(line[5:])


def _bodies(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    if args.workload:
        lines = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()]
        return [dict(lines[i % len(lines)]) for i in range(args.num_requests)]
    width, height = args.size
    bodies = []
    for _ in range(args.num_requests):
        # Unique prompts (a counter appended) unless asked: a daemon caches encoded prompts, a plain loop does not.
        prompt = args.prompt if getattr(args, "same_prompt", False) else f"{args.prompt}, {next(_UNIQUE)}"
        body = {"prompt": prompt, "seed": rng.randrange(2**31), "num_inference_steps": args.steps}
        if args.guidance_scale is not None:
            body["guidance_scale"] = args.guidance_scale
        if args.api == "native":
            body |= {"width": width, "height": height, "preview_every": 1 if args.stream else 0}
        else:
            body |= {"size": f"{width}x{height}"}
            if args.stream:
                body |= {"stream": True, "partial_images": 1}
        bodies.append(body)
    return bodies


async def _queue_wait(session: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float] | None:
    """(sum, count) of the queue wait histograms of every daemon in `urls`, or None if one is unreachable."""
    total, count = 0.0, 0.0
    for url in urls:
        try:
            async with session.get(url.rstrip("/") + "/metrics") as resp:
                text = await resp.text()
        except aiohttp.ClientError:
            return None
        values = {}
        for suffix in ("sum", "count"):
            match = re.search(rf"^diffusiond_queue_wait_seconds_{suffix} (\S+)$", text, re.M)
            if match is None:
                return None
            values[suffix] = float(match.group(1))
        total, count = total + values["sum"], count + values["count"]
    return total, count


async def run_load(args: argparse.Namespace, progress=None) -> Summary:
    load = Load(args.base_url.rstrip("/"), args.api, args.stream, _bodies(args), args.api_key)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        metrics_urls = args.metrics_url or [load.base_url]
        before = await _queue_wait(session, metrics_urls)
        t0 = time.perf_counter()

        async def record(body: dict) -> None:
            load.outcomes.append(await load.one(session, body))
            if progress is not None:
                progress(len(load.outcomes), len(load.bodies))

        if args.request_rate:
            rng = random.Random(args.seed + 1)
            tasks = []
            for body in load.bodies:
                tasks.append(asyncio.create_task(record(body)))
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
            await asyncio.gather(*tasks)
        else:
            queue: asyncio.Queue[dict] = asyncio.Queue()
            for body in load.bodies:
                queue.put_nowait(body)

            async def worker() -> None:
                while not queue.empty():
                    await record(queue.get_nowait())

            await asyncio.gather(*(worker() for _ in range(max(1, args.concurrency))))
        duration = time.perf_counter() - t0
        after = await _queue_wait(session, metrics_urls)
    return summarize(load.outcomes, duration, args, before, after)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def summarize(outcomes: list[Outcome], duration: float, args, before, after) -> Summary:
    ok = [o for o in outcomes if o.ok]
    bad = [o for o in outcomes if not o.ok]
    refused: dict[str, int] = {}
    errors: dict[str, int] = {}
    for o in bad:
        if o.status in (429, 503):
            refused[str(o.status)] = refused.get(str(o.status), 0) + 1
        else:
            key = f"{o.status}:{o.error}" if o.status else o.error
            errors[key] = errors.get(key, 0) + 1
    queue_wait = None
    # A daemon that restarted during the run resets its histogram: then there is no mean to report.
    if before is not None and after is not None and after[1] > before[1] and after[0] >= before[0]:
        queue_wait = (after[0] - before[0]) / (after[1] - before[1])
    previews = [o.first_preview for o in ok if o.first_preview is not None]
    slo = args.slo
    groups = None
    if args.workload:
        names = sorted({o.group for o in outcomes})
        groups = {name: _group([o for o in outcomes if o.group == name], slo) for name in names}
    return Summary(
        requests=len(outcomes),
        completed=len(ok),
        failed=len(bad),
        refused=refused,
        errors=errors,
        duration_s=duration,
        images_per_s=sum(o.images for o in ok) / duration if duration > 0 else 0.0,
        latency_s=_percentiles([o.latency for o in ok]),
        time_to_first_preview_s=_percentiles(previews) if previews else None,
        queue_wait_mean_s=queue_wait,
        slo_s=slo,
        slo_attainment=(sum(o.latency <= slo for o in ok) / len(outcomes)) if slo and outcomes else None,
        concurrency=None if args.request_rate else args.concurrency,
        request_rate=args.request_rate,
        groups=groups,
    )


def _group(outcomes: list[Outcome], slo: float | None) -> Group:
    ok = [o for o in outcomes if o.ok]
    previews = [o.first_preview for o in ok if o.first_preview is not None]
    return Group(
        requests=len(outcomes),
        completed=len(ok),
        refused=sum(o.status in (429, 503) for o in outcomes),
        latency_s=_percentiles([o.latency for o in ok]),
        time_to_first_preview_s=_percentiles(previews) if previews else None,
        slo_attainment=(sum(o.latency <= slo for o in ok) / len(outcomes)) if slo else None,
    )


def print_table(s: Summary, out=None) -> None:
    out = out or sys.stdout
    load = f"{s.request_rate:g} req/s (Poisson)" if s.request_rate else f"concurrency {s.concurrency}"
    rows = [
        ("requests", f"{s.requests} ({load})"),
        ("completed / failed", f"{s.completed} / {s.failed}"),
    ]
    if s.refused:
        rows.append(("refused", ", ".join(f"{n} x {code}" for code, n in sorted(s.refused.items()))))
    if s.errors:
        rows.append(("errors", ", ".join(f"{n} x {kind}" for kind, n in sorted(s.errors.items()))))
    rows += [("duration", f"{s.duration_s:.2f} s"), ("images/s", f"{s.images_per_s:.3f}")]
    for name, values in (("latency", s.latency_s), ("time to first preview", s.time_to_first_preview_s)):
        if values:
            rows.append(
                (
                    f"{name} mean/p50/p90/p99",
                    " / ".join(f"{values[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")) + " ms",
                )
            )
    if s.queue_wait_mean_s is not None:
        rows.append(("queue wait mean (daemon)", f"{s.queue_wait_mean_s * 1e3:.1f} ms"))
    if s.slo_attainment is not None:
        rows.append((f"SLO {s.slo_s:g} s attained", f"{s.slo_attainment * 100:.1f}%"))
    for name, g in (s.groups or {}).items():
        line = f"{g.completed}/{g.requests} completed"
        line += f", {g.refused} refused" if g.refused else ""
        for what, values in (("latency", g.latency_s), ("first preview", g.time_to_first_preview_s)):
            if values:
                line += f", {what} p50/p99 {values['p50'] * 1e3:.1f}/{values['p99'] * 1e3:.1f} ms"
        if g.slo_attainment is not None:
            line += f", SLO {g.slo_attainment * 100:.1f}%"
        rows.append((f"[{name}]", line))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)


def _progress_bar():
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None, None
    bar = tqdm(unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return update, bar


def add_args(parser: argparse.ArgumentParser) -> None:
    from diffusiond.daemon.cli import parse_size

    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--api", choices=["openai", "native"], default="openai")
    parser.add_argument("--num-requests", type=int, default=32)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead of a fixed concurrency")
    parser.add_argument("--size", type=parse_size, default=(256, 256))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float)
    parser.add_argument("--prompt", default="a red circle at the top left on a blue background")
    parser.add_argument(
        "--same-prompt", action="store_true", help="send --prompt as is (default: a counter makes each prompt unique)"
    )
    parser.add_argument("--stream", action="store_true", help="stream, and measure time to first preview")
    parser.add_argument("--workload", metavar="FILE", help="JSON lines of request bodies, used in turn")
    parser.add_argument("--slo", type=float, metavar="SECONDS", help="report the share of requests within it")
    parser.add_argument(
        "--metrics-url",
        action="append",
        metavar="URL",
        help="daemon whose /metrics gives the queue wait; repeat it for each replica behind a balancer "
        "(default: --base-url)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--json", metavar="OUT", help="write the summary as JSON")
    parser.add_argument("--no-progress", action="store_true")


def bench_serve(args: argparse.Namespace) -> int:
    update, bar = (None, None) if args.no_progress else _progress_bar()
    try:
        summary = asyncio.run(run_load(args, update))
    finally:
        if bar is not None:
            bar.close()
    print_table(summary)
    if args.json:
        Path(args.json).write_text(msgspec.json.format(msgspec.json.encode(summary)).decode())
    return 0
