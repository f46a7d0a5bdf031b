"""Soak a daemon as a hostile client would, and report what was lost, duplicated or leaked.

    python bench/soak.py [--model DIR] [--requests 2000] [--concurrency 32] [--warmup 200] [--json OUT]

Starts `diffusiond serve` (bundled model unless --model; an API key is set), then:
1. mixed requests at the given concurrency: native SSE streams, OpenAI non-streaming and streaming with partial
   images, sizes 32-64, 2-6 steps; 10% of clients hang up mid-stream, 5% DELETE their request mid-flight;
2. a burst past the queue (max_batch + max_queue + 50 at once): the excess must get 429, the rest finish;
3. a client that never reads a large stream, while others are served;
4. 1000 malformed bodies (none may get 5xx) and bad credentials (401);
then checks that every admitted request ended in exactly one terminal state, nothing is in flight, and how much the
daemon's RSS grew over the mixed phase. Not a test (it takes a minute or two); numbers go in notes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from diffusiond.bench.serve import sse_events
from diffusiond.daemon.launch import free_port

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TERMINAL = {"completed", "cancelled", "failed", "image_generation.completed", "error"}


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


class Soak:
    def __init__(
        self, base: str, rng: random.Random, sides: tuple[int, ...] = (32, 48, 64), min_steps: int = 2
    ) -> None:
        self.base = base
        self.rng = rng
        # Square sizes the model serves (from /v1/models; the bundled model makes 64x64 only).
        self.sides = sides
        self.min_steps = min_steps
        self.admitted: set[str] = set()
        self.terminals: Counter[str] = Counter()  # request id -> terminal events seen by its client
        self.unfinished_streams = 0  # streams that ended without a terminal event although the client read them all
        self.kinds: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()

    def body(self) -> tuple[str, dict, str]:
        side = self.rng.choice(self.sides)
        steps = self.rng.randint(self.min_steps, self.min_steps + 4)
        seed = self.rng.randrange(2**31)
        kind = self.rng.choices(["native", "openai", "openai-stream"], [4, 3, 3])[0]
        if kind == "native":
            body = {"prompt": "a red circle", "width": side, "height": side, "num_inference_steps": steps, "seed": seed}
            body["preview_every"] = self.rng.choice([0, 1, 2])
            return "/v1/generations", body, kind
        body = {"prompt": "a blue square", "size": f"{side}x{side}", "num_inference_steps": steps, "seed": seed}
        if kind == "openai-stream":
            body |= {"stream": True, "partial_images": self.rng.randint(0, 2), "n": self.rng.choice([1, 1, 2])}
        return "/v1/images/generations", body, kind

    async def one(self, session: aiohttp.ClientSession) -> None:
        route, body, kind = self.body()
        action = self.rng.choices(["read", "hang-up", "delete"], [85, 10, 5])[0] if kind != "openai" else "read"
        self.kinds[f"{kind}/{action}"] += 1
        async with session.post(self.base + route, json=body, headers=AUTH) as resp:
            self.statuses[resp.status] += 1
            if resp.status != 200:
                return
            ids = resp.headers["X-Request-Id"].split(",")
            self.admitted.update(ids)
            if kind == "openai":
                await resp.read()
                self.terminals.update(ids)  # one JSON answer for all n images: their terminal states
                return
            seen: Counter[str] = Counter()
            async for name, data in sse_events(resp):
                if name in TERMINAL:
                    seen[data.get("id", ids[0])] += 1
                if action != "read" and name in ("progress", "image_generation.partial_image", "queued"):
                    if action == "delete":
                        for rid in ids:
                            await session.delete(f"{self.base}/v1/generations/{rid}", headers=AUTH)
                        action = "read"
                    else:
                        resp.close()  # hang up
                        return
            self.terminals.update(seen)
            if sum(seen[rid] for rid in ids) < len(ids):
                self.unfinished_streams += 1

    async def mixed(self, session, total: int, concurrency: int) -> None:
        queue = asyncio.Queue()
        for _ in range(total):
            queue.put_nowait(None)

        async def worker():
            while not queue.empty():
                queue.get_nowait()
                await self.one(session)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def never_reader(base: str) -> None:
    body = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 40, "preview_every": 1, "latents": True}
    data = json.dumps(body).encode()
    _reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
    writer.write(
        b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Length: "
        + str(len(data)).encode()
        + b"\r\n\r\n"
        + data
    )
    await writer.drain()
    await asyncio.sleep(5)  # never read a byte
    writer.close()


def malformed_bodies(rng: random.Random, n: int) -> list[bytes]:
    junk = [None, True, -1, 2**64, -(2**64), 1e308, "", "x" * 300, [], {}, "0x0", "99999x99999"]
    out = []
    for _ in range(n):
        body = {"prompt": "x", "size": "64x64", "num_inference_steps": 1}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(["prompt", "n", "size", "seed", "num_inference_steps", "guidance_scale", "zzz"])] = (
                rng.choice(junk)
            )
        text = json.dumps(body)
        out.append(text.encode()[: rng.randint(1, len(text))] if rng.random() < 0.2 else text.encode())
    return out


async def served(session, base: str) -> tuple[tuple[int, ...], int]:
    """The square sizes up to 64 the model serves (its declared sizes, else 32, 48 and 64) and its fewest steps."""
    async with session.get(base + "/v1/models", headers=AUTH) as resp:
        caps = (await resp.json())["data"][0].get("diffusiond", {})
    sides = [tuple(int(v) for v in size.split("x")) for size in caps.get("sizes") or ()]
    squares = tuple(w for w, h in sides if w == h and w <= 64)
    return squares or (32, 48, 64), max(2, (caps.get("steps") or [2])[0])


async def metric(session, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


async def run(args, base: str, pid: int) -> dict:
    rng = random.Random(args.seed)
    report: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(base + "/ready") as resp:
                    if resp.status == 200:
                        break
            await asyncio.sleep(0.2)
        sides, min_steps = await served(session, base)
        soak = Soak(base, rng, sides, min_steps)
        # Warm the allocator at full concurrency first: the first batches of every size raise its high-water mark
        # (measured: +7.8% over the first 500 requests after a warm-up at concurrency 8, then +0.45% per 1500).
        await soak.mixed(session, args.warmup, args.concurrency)
        rss0 = rss_kib(pid)
        t0 = time.perf_counter()
        trajectory = []
        parts = max(4, args.requests // 1000)
        for _ in range(parts):  # RSS after each part: growth that levels off is the allocator, not a leak
            await soak.mixed(session, args.requests // parts, args.concurrency)
            trajectory.append(rss_kib(pid))
        report["mixed_seconds"] = round(time.perf_counter() - t0, 1)
        await asyncio.sleep(1)
        rss1 = rss_kib(pid)
        report["rss_kib after each part"] = trajectory

        # a burst past the queue
        burst = Soak(base, rng, sides, min_steps)
        await asyncio.gather(*(burst.one(session) for _ in range(8 + args.queue + 50)))

        # a client that never reads, while others are served
        reader = asyncio.create_task(never_reader(base))
        during = Soak(base, rng, sides, min_steps)
        await during.mixed(session, 50, 8)
        await reader

        # malformed bodies and bad credentials
        bad: Counter[int] = Counter()
        for data in malformed_bodies(rng, 1000):
            async with session.post(
                base + "/v1/images/generations", data=data, headers={**AUTH, "Content-Type": "application/json"}
            ) as resp:
                bad[resp.status] += 1
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            async with session.post(base + "/v1/generations", json={"prompt": "x"}, headers=headers) as resp:
                bad[resp.status] += 1

        # everything settles
        for _ in range(300):
            if await metric(session, base, "diffusiond_requests_running") == 0:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)
        not_terminal, forgotten = [], 0
        admitted = soak.admitted | burst.admitted | during.admitted
        for rid in admitted:
            async with session.get(f"{base}/v1/generations/{rid}", headers=AUTH) as resp:
                if resp.status == 404:  # its status record made room for newer ones (MAX_RECORDS)
                    forgotten += 1
                    continue
                record = await resp.json()
            if record.get("status") not in ("completed", "cancelled", "failed"):
                not_terminal.append(record)
        outcomes = {}
        for outcome in ("completed", "cancelled", "failed"):
            outcomes[outcome] = await metric(session, base, f'diffusiond_requests_total{{outcome="{outcome}"}}')
        report["status records forgotten (older than the newest 4096)"] = forgotten
        # Every admitted request counted once by its outcome (the metrics keep no record cap).
        report["lost by the metrics (admitted - terminal)"] = len(admitted) - int(sum(outcomes.values()))
        report |= {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "kinds": dict(soak.kinds),
            "statuses": dict(soak.statuses),
            "admitted": len(soak.admitted),
            "lost (admitted, record not terminal)": len(not_terminal),
            "duplicated terminal events": sum(1 for c in soak.terminals.values() if c > 1),
            "streams read to the end without a terminal event": soak.unfinished_streams,
            "burst statuses": dict(burst.statuses),
            "served while a client never read": dict(during.statuses),
            "malformed + bad credentials statuses": dict(bad),
            "in flight at the end (running, waiting)": (
                await metric(session, base, "diffusiond_requests_running"),
                await metric(session, base, "diffusiond_requests_waiting"),
            ),
            "outcomes (metrics)": outcomes,
            "rss_kib before/after mixed": (rss0, rss1),
            "rss growth %": round(100 * (rss1 - rss0) / rss0, 1),
        }
        async with session.get(base + "/health") as resp:
            report["health"] = resp.status
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200, help="requests before RSS is first measured")
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--log", default="soak-daemon.log")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.queue = max(64, 2 * args.concurrency)
    port = free_port()
    # Room for every client's images (n <= 2): a client refused with 429 comes straight back, so a queue smaller than
    # that makes a soak of 429s (measured at concurrency 64 with a queue of 64: 83% of the requests).
    cmd = [sys.executable, "-m", "diffusiond", "serve", "--port", str(port), "--api-key", KEY]
    cmd += ["--max-queue", str(args.queue)]
    if args.model:
        cmd += ["--model", args.model]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    with open(args.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            report = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc.pid))
        finally:
            proc.terminate()
            proc.wait(60)
    text = Path(args.log).read_text()
    report["daemon log ERROR lines"] = sum(1 for line in text.splitlines() if " ERROR " in line or "Traceback" in line)
    report["daemon exit code after SIGTERM"] = proc.returncode
    for key, value in report.items():
        print(f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
