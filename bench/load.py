"""`diffusiond bench load --model DIR`: loading, resident memory and heals at real size, side by side (issue 31).

One run measures, for the same checkpoint (a real-size one: `diffusiond make-tiny --family sd35 --real-size`):
1. diffusers: a clean process that loads the pipeline with `from_pretrained` and makes one image: seconds to
   loaded and to the image, and the process's peak resident memory (VmHWM);
2. `diffusiond serve` (one rank): seconds from start to ready and to the first image, its peak resident memory;
3. each layout given with `--layout` (default: `--tp 2`, and `--cfg-parallel 2 --shard-weights`), on 2 ranks: the
   same, every rank's peak resident memory, and the time from a follower's death (SIGKILL) to ready again.
It prints the ratios the goals are stated in: peak RSS over diffusers' (goal <= 1.15x), each rank's over one
process's (goal <= 0.6x), seconds to heal (goal < 10 s). Peak RSS is read from /proc (VmHWM), never summed tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from diffusiond.daemon.launch import free_port

LAYOUTS = ("--tp 2", "--cfg-parallel 2 --shard-weights")
# The request each side makes: small, so that the compute is seconds even at real size on a CPU.
SIZE, STEPS = 256, 2


def peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                out.append(child)
                todo.append(child)
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if not any(e.startswith(b"_DIFFUSIOND_RANK_CONFIG=") for e in env):
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


DIFFUSERS = """
import json, re, sys, time
t0 = time.perf_counter()
import diffusers, torch
torch.set_num_threads({threads})
cls = getattr(diffusers, json.load(open({model!r} + "/model_index.json"))["_class_name"])
pipe = cls.from_pretrained({model!r}, dtype=torch.bfloat16)
loaded = time.perf_counter() - t0
pipe.set_progress_bar_config(disable=True)
extra = {{"num_frames": 5}} if "Wan" in type(pipe).__name__ else {{}}
pipe(prompt="a red circle", width={size}, height={size}, num_inference_steps={steps},
     generator=torch.Generator().manual_seed(1), **extra)
image = time.perf_counter() - t0
hwm = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
print(json.dumps({{"loaded_s": loaded, "image_s": image, "peak_mib": hwm}}))
"""


def diffusers_side(model: str, threads: int) -> dict:
    code = DIFFUSERS.format(model=model, threads=threads, size=SIZE, steps=STEPS)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the diffusers side failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _request(base: str, timeout: float = 1800) -> None:
    body = {"prompt": "a red circle", "width": SIZE, "height": SIZE, "num_inference_steps": STEPS, "seed": 1}
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{base}/v1/generations", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        text = resp.read().decode()
    if "event: completed" not in text:
        raise RuntimeError(f"no image: {text[-500:]}")


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _wait(predicate, within: float, proc: subprocess.Popen, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() - t0 > within:
            raise RuntimeError(f"no {what} within {within:g} s")
        time.sleep(0.1)
    return time.monotonic() - t0


def daemon_side(model: str, threads: int, layout: str, log: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ranks = 2 if layout else 1
    cmd = [sys.executable, "-m", "diffusiond", "serve", "--model", model, "--port", str(port), "--dtype", "bfloat16"]
    cmd += ["--threads", str(threads // ranks or 1), "--max-pixels", str(SIZE * SIZE)]
    cmd += ["--nproc", str(ranks), *layout.split()] if layout else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        report = {"ready_s": _wait(lambda: _ready(base), 1800, proc, "/ready")}
        _request(base)
        report["image_s"] = time.monotonic() - t0
        pids = {0: proc.pid} if not layout else {r: p for p in descendants(proc.pid) if (r := rank_of(p)) is not None}
        report["peak_mib"] = {rank: peak_rss_mib(pid) for rank, pid in sorted(pids.items())}
        if layout:
            os.kill(pids[1], signal.SIGKILL)
            killed = time.monotonic()
            _wait(lambda: not _ready(base), 30, proc, "/ready to fail")
            _wait(lambda: _ready(base), 600, proc, "/ready after the heal")
            report["heal_s"] = time.monotonic() - killed
        return report
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def bench_load(args: argparse.Namespace) -> int:
    model = str(Path(args.model).resolve())
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    results = {"model": model, "size": f"{SIZE}x{SIZE}", "steps": STEPS, "threads": args.threads}
    print(f"{model}: one {SIZE}x{SIZE} image, {STEPS} steps, {args.threads} threads", flush=True)
    base = diffusers_side(model, args.threads)
    results["diffusers"] = base
    print(f"diffusers:       loaded {base['loaded_s']:5.1f} s, image {base['image_s']:5.1f} s, "
          f"peak {base['peak_mib']:6.0f} MiB", flush=True)  # fmt: skip
    one = daemon_side(model, args.threads, "", logs / "serve-1.log")
    results["serve"] = one
    one_peak = one["peak_mib"][0]
    print(f"serve, 1 rank:   ready  {one['ready_s']:5.1f} s, image {one['image_s']:5.1f} s, peak {one_peak:6.0f} MiB "
          f"= {one_peak / base['peak_mib']:.2f}x diffusers (goal <= 1.15x)", flush=True)  # fmt: skip
    for layout in args.layout or LAYOUTS:
        name = re.sub(r"\W+", "-", layout).strip("-")
        r = daemon_side(model, args.threads, layout, logs / f"serve-{name}.log")
        results[layout] = r
        peaks = ", ".join(f"rank {k} {v:.0f} MiB ({v / one_peak:.2f}x)" for k, v in r["peak_mib"].items())
        print(f"serve {layout}: ready {r['ready_s']:5.1f} s, image {r['image_s']:5.1f} s; {peaks} of one process "
              f"(goal <= 0.6x); healed {r['heal_s']:.1f} s after a follower's death (goal < 10 s)",
              flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a checkpoint folder (make-tiny --real-size writes one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, over all ranks")
    parser.add_argument("--layout", action="append", help=f"a 2-rank layout's flags (default: {' and '.join(LAYOUTS)})")
    parser.add_argument("--logs", default="bench-load-logs", help="the daemons' logs")
    parser.add_argument("--json")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    raise SystemExit(bench_load(parser.parse_args()))
