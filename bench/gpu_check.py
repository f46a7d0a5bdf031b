"""The GPU acceptance check: the one thing to run the day a GPU is lent (issue 31).

    python -m diffusiond.bench.gpu_check                  # on cuda:0: every row, a few minutes on one H100/H200
    python -m diffusiond.bench.gpu_check --device cpu     # its structure, as CI runs it (CUDA rows say "needs CUDA")
    python -m diffusiond.bench.gpu_check --json out.json  # the rows as JSON too

Offline: it builds the tiny checkpoints it needs (models/tiny/__init__.py) in a temporary folder, and the VAEs of the
decode rows from their real configurations with random weights. It prints one table, a row per check (what, ok / FAILED
/ skipped, seconds, what it found); a row that fails prints its error and the others still run; the exit code is 1 when
any row failed. The rows: the environment; every family loaded in the GPU's dtype (bf16); two steps of every family
with prompts of different lengths and a negative prompt under each attention kernel that can run here, against SDPA;
host syncs per step (`torch.cuda.set_sync_debug_mode`); a served run of 8 concurrent streams with previews; one
request over HTTP against a clean diffusers process; `--compile` warm-up and recompiles across batch sizes;
`--quantize` int8 and fp8 in bf16; `--offload`; peak decode memory for 8 images of 1024 x 1024 and one Wan clip of
81 x 480 x 832; one 1024 x 1024 decode with the VAE's weights as loaded and channels-last (the CPU's layout); the plan
broadcast and fault board of a world of one (NCCL on a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Families whose tiny checkpoints every per-family row runs on (models/tiny/__init__.py FAMILIES).
FAMILIES = ("sd3", "sd35", "sdxl", "flux", "flux-kontext", "flux2-klein", "z-image", "qwen-image", "wan", "wan-i2v")
# Kernels the two-step rows try besides SDPA, where they can run (kernels/attention.py resolve).
KERNELS = ("flash", "flash3", "sage", "xformers", "efficient", "cudnn", "math")


@dataclass
class Row:
    check: str
    status: str  # "ok", "FAILED" or "skipped"
    seconds: float
    found: str


class GpuCheck:
    def __init__(self, device: str, work: Path, quick: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        self.dtype = "bfloat16" if self.cuda else "float32"
        self.work = work
        self.quick = quick
        self.rows: list[Row] = []
        self._models: dict[str, str] = {}

    # ---- running rows ----

    def row(self, check: str, fn: Callable[[], str], *, cuda: bool = False) -> None:
        if cuda and not self.cuda:
            self._add(Row(check, "skipped", 0.0, "needs CUDA"))
            return
        t0 = time.perf_counter()
        try:
            found, status = fn(), "ok"
        except Exception as exc:
            found, status = f"{type(exc).__name__}: {exc}".splitlines()[0][:160], "FAILED"
            traceback.print_exc(file=sys.stderr)
        self._add(Row(check, status, time.perf_counter() - t0, found))

    def _add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"{row.check:<44} {row.status:<8} {row.seconds:7.1f} s  {row.found}", flush=True)

    def model(self, family: str) -> str:
        if family not in self._models:
            from diffusiond.models.preview import write_preview_factors
            from diffusiond.models.tiny import build_tiny

            path = build_tiny(family, self.work / family)
            write_preview_factors(path)
            self._models[family] = str(path)
        return self._models[family]

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    # ---- the rows ----

    def environment(self) -> str:
        torch = self.torch
        parts = [f"torch {torch.__version__}", f"diffusers {importlib.metadata.version('diffusers')}"]
        if self.cuda:
            index = torch.device(self.device).index or 0
            major, minor = torch.cuda.get_device_capability(index)
            parts += [f"CUDA {torch.version.cuda}", f"{torch.cuda.get_device_name(index)} (sm {major}.{minor})"]
            parts.append(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        for package in ("flash-attn", "torchao", "xformers"):
            try:
                parts.append(f"{package} {importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                parts.append(f"no {package}")
        return ", ".join(parts)

    def load(self, family: str) -> str:
        from diffusiond.models.loading.loader import load_adapter

        adapter = load_adapter(self.model(family), device=self.device, dtype=self.dtype)
        return f"{type(adapter).__name__} in {adapter.dtype}, attention {adapter.set_attention('auto')}"

    def two_steps(self, family: str) -> str:
        """Two requests batched (texts of different lengths, a negative prompt: masks where a family pads), two
        steps, under SDPA and each other kernel that can run here; the largest difference from SDPA's images."""
        import numpy as np

        from diffusiond.kernels import attention
        from diffusiond.models.loading.loader import load_adapter

        images, found = {}, []
        for kernel in ("sdpa", *KERNELS):
            try:
                attention.resolve(kernel, self.device, getattr(self.torch, self.dtype))
            except attention.AttentionUnavailable:
                continue
            adapter = load_adapter(self.model(family), device=self.device, dtype=self.dtype)
            try:
                adapter.set_attention(kernel)
            except ValueError:  # the family runs SDPA only (SDXL's UNet)
                continue
            images[kernel] = self._generate(adapter, steps=2)
            if not all(np.isfinite(image).all() for image in images[kernel]):
                raise RuntimeError(f"{kernel}: images with NaN or inf")
            if kernel != "sdpa":
                diff = max(float(np.abs(a - b).max()) for a, b in zip(images["sdpa"], images[kernel], strict=True))
                found.append(f"{kernel} {diff:.3f}")
        return "vs sdpa: " + (", ".join(found) or "no other kernel here")

    def _generate(self, adapter, steps: int, count: int = 2, previews: int = 0) -> list:
        from diffusiond.engine.engine import Engine
        from diffusiond.engine.outputs import Completed
        from diffusiond.models.params import SamplingParams

        caps = adapter.capabilities
        side = -(-64 // caps.size_multiple) * caps.size_multiple  # 64, or the family's multiple above it
        prompts = ["a red circle", "a very long description of a small blue square on a white floor at noon"]
        requests = []
        for i in range(count):
            negative = i == 0 and caps.supports_negative_prompt
            extra = {"negative_prompt": "blurry, dark, low quality"} if negative else {}
            if caps.modality == "video":
                extra["num_frames"] = 5
            if "first-frame" in caps.image_inputs or "edit" in caps.image_inputs:
                extra["image"] = _png(side)
            requests.append(
                SamplingParams(
                    prompt=prompts[i % 2],
                    seed=i,
                    width=side,
                    height=side,
                    num_inference_steps=steps,
                    preview_every=previews,
                    **extra,
                )
            )

        async def run():
            engine = Engine(adapter, max_batch=max(4, count), batch_wait=0.5)
            await engine.start()
            try:
                results = [await h.result() for h in [engine.add_request(p) for p in requests]]
            finally:
                await engine.stop()
            failed = [r for r in results if not isinstance(r, Completed)]
            if failed:
                raise RuntimeError(f"{failed[0]}")
            return [r.image for r in results]

        return asyncio.run(run())

    def host_syncs(self) -> str:
        from diffusiond.models.loading.loader import load_adapter

        adapter = load_adapter(self.model("sd3"), device=self.device, dtype=self.dtype)
        self._generate(adapter, steps=2)  # warm
        torch = self.torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self._generate(adapter, steps=4, count=4)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:4]
        return f"{len(syncs)} syncs in 4 steps of 4 requests (prepare and decode included): {', '.join(where)}"

    def served(self) -> str:
        """`diffusiond serve` on this device, 8 concurrent native streams with a preview every step."""
        from diffusiond.bench.compare import Daemon

        daemon = Daemon(self.model("sd3"), 2, self.work / "served.log", ["--device", self.device])
        try:
            daemon.wait_ready()
            body = {"prompt": "a red circle", "width": 64, "height": 64, "num_inference_steps": 8, "preview_every": 1}
            t0 = time.perf_counter()
            outcomes = asyncio.run(_streams(daemon.base_url, body, 8))
            took = time.perf_counter() - t0
        finally:
            daemon.stop()
        completed = sum(1 for names in outcomes if names and names[-1] == "completed")
        previews = sum(names.count("preview") for names in outcomes)
        if completed != 8:
            raise RuntimeError(f"{completed} of 8 completed: {[n[-1:] for n in outcomes]}")
        return f"8 of 8 completed in {took:.2f} s, {previews} previews"

    def overhead(self) -> str:
        """One request at a time over HTTP against `pipeline(...)` in a clean diffusers process, alternating."""
        from diffusiond.bench.baseline import Baseline, Job
        from diffusiond.bench.compare import Daemon

        model = self.model("sd3")
        daemon = Daemon(model, 2, self.work / "overhead.log", ["--device", self.device])
        try:
            daemon.wait_ready()
            job = Job(model, 64, 64, 8, 4.0, 2, device=self.device, dtype=self.dtype)
            with Baseline(job) as baseline:
                ours, theirs = [], []
                for _ in range(3 if self.quick else 10):
                    theirs.append(baseline.run("single"))
                    ours.append(_http_image(daemon.base_url, 64, 8, 4.0))
        finally:
            daemon.stop()
        a, b = statistics.median(ours), statistics.median(theirs)
        return f"daemon {1000 * a:.0f} ms, diffusers {1000 * b:.0f} ms: {a / b:.2f}x (goal <= 1.03x)"

    def compiled(self) -> str:
        from torch._dynamo.utils import counters

        from diffusiond.models.loading.loader import load_adapter

        adapter = load_adapter(self.model("flux"), device=self.device, dtype=self.dtype)
        blocks = adapter.enable_compile()
        t0 = time.perf_counter()
        self._generate(adapter, steps=2, count=1)
        warm = time.perf_counter() - t0
        graphs = counters["stats"]["unique_graphs"]
        for count in (2, 3, 4):
            self._generate(adapter, steps=2, count=count)
        more = counters["stats"]["unique_graphs"] - graphs
        return f"{blocks} blocks, warm-up {warm:.1f} s; new graphs for batch sizes 2-4: {more}"

    def quantized(self, choice: str, family: str = "flux") -> str:
        from diffusiond.kernels.quantize import check
        from diffusiond.models.loading.loader import load_adapter

        check(choice, self.device)
        adapter = load_adapter(self.model(family), device=self.device, dtype=self.dtype, quantize=choice)
        self._generate(adapter, steps=2)
        return f"{adapter.quantized[1]} linears in {choice}, two steps ran"

    def offloaded(self, mode: str) -> str:
        from diffusiond.models.loading.loader import load_adapter

        torch = self.torch
        torch.cuda.reset_peak_memory_stats(self.device)
        adapter = load_adapter(self.model("flux"), device=self.device, dtype=self.dtype, offload=mode)
        self._generate(adapter, steps=2)
        return f"two steps ran; peak {torch.cuda.max_memory_allocated(self.device) / 2**20:.0f} MiB on the GPU"

    def decode_peak(self, kind: str) -> str:
        """A VAE of the real configuration (random weights): its peak memory decoding what DECODE_PIXELS lets one
        call decode, and the whole job (8 images of 1024 x 1024, or one Wan clip of 81 x 480 x 832)."""
        from diffusers import AutoencoderKL, AutoencoderKLWan

        from diffusiond.models.flowmatch.decoding import DECODE_PIXELS
        from diffusiond.models.tiny.real import SD3_VAE

        torch = self.torch
        dtype = getattr(torch, self.dtype)
        if kind == "image":
            vae = AutoencoderKL(**SD3_VAE).to(self.device, dtype)
            latents, each = torch.randn(8, 16, 128, 128, device=self.device, dtype=dtype), 1024 * 1024
        else:
            vae = AutoencoderKLWan().to(self.device, dtype)  # its defaults are Wan 2.1's VAE
            latents, each = torch.randn(1, 16, 21, 60, 104, device=self.device, dtype=dtype), 81 * 480 * 832
        per_call = max(1, DECODE_PIXELS // each)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            for i in range(0, latents.shape[0], per_call):
                vae.decode(latents[i : i + per_call], return_dict=False)
        self.sync()
        peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2**30
        return f"{latents.shape[0]} in calls of {per_call}: peak {peak:.2f} GiB above the weights"

    def decode_layout(self) -> str:
        """One 1024 x 1024 image through a VAE of SD3's configuration (random weights), its weights as loaded and then
        channels-last: the CPU converts 2-D VAEs (models/loading/pipelines.py `channels_last_vae`, measured 0.7-0.8x
        there), GPUs do not until this row says whether it pays there."""
        from diffusers import AutoencoderKL

        from diffusiond.models.tiny.real import SD3_VAE

        torch = self.torch
        dtype = getattr(torch, self.dtype)
        vae = AutoencoderKL(**SD3_VAE).to(self.device, dtype)
        latents = torch.randn(1, 16, 128, 128, device=self.device, dtype=dtype)
        took, images = {}, {}
        with torch.inference_mode():
            for layout in (torch.contiguous_format, torch.channels_last, torch.contiguous_format, torch.channels_last):
                vae.to(memory_format=layout)
                vae.decode(latents, return_dict=False)
                self.sync()
                t0 = time.perf_counter()
                for _ in range(3):
                    images[layout] = vae.decode(latents, return_dict=False)[0]
                self.sync()
                took.setdefault(layout, []).append((time.perf_counter() - t0) / 3)
        plain, last = (min(took[layout]) for layout in (torch.contiguous_format, torch.channels_last))
        diff = float((images[torch.contiguous_format] - images[torch.channels_last]).abs().max())
        ratio = f"({last / plain:.2f}x); max diff {diff:.1e}"
        return f"as loaded {plain * 1e3:.1f} ms, channels-last {last * 1e3:.1f} ms {ratio}"

    def plan_broadcast(self) -> str:
        """A world of one on this device's backend: a typical plan's broadcast, and the fault board's round trip."""
        import datetime

        import torch.distributed as dist

        from diffusiond.bench.compare import free_port
        from diffusiond.engine.comm import TorchComm
        from diffusiond.engine.fault_board import FaultBoard
        from diffusiond.engine.wire import StepPlan, encode_plan

        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
        backend = "nccl" if self.cuda else "gloo"
        device_id = self.torch.device(self.device) if self.cuda else None
        dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device_id)
        try:
            comm = TorchComm(device=self.device, plan_group=dist.new_group(backend="gloo"), faults=FaultBoard(store))
            plan = encode_plan(StepPlan(step=7, advance=[f"{i:032x}" for i in range(8)]))
            for _ in range(20):
                comm.broadcast(plan)
            t0 = time.perf_counter()
            for _ in range(500):
                comm.broadcast(plan)
            each = (time.perf_counter() - t0) / 500
            t0 = time.perf_counter()
            comm.report_fault("rank 1 failed (a drill)")
            seen = comm.fault()
            board = time.perf_counter() - t0
        finally:
            dist.destroy_process_group()
        if seen != "rank 1 failed (a drill)":
            raise RuntimeError(f"the fault board read {seen!r}")
        return f"{backend} world: plan broadcast {1e6 * each:.0f} us; fault board report + read {1e3 * board:.1f} ms"

    def run(self) -> int:
        self.row("environment", self.environment)
        for family in FAMILIES:
            self.row(f"load {family} ({self.dtype})", lambda f=family: self.load(f))
        for family in FAMILIES:
            self.row(f"two steps {family}, every kernel", lambda f=family: self.two_steps(f))
        self.row("host syncs per step", self.host_syncs, cuda=True)
        self.row("served: 8 streams with previews", self.served)
        self.row("one request vs a clean diffusers process", self.overhead)
        self.row("--compile: warm-up, recompiles", self.compiled, cuda=True)
        self.row("--quantize int8", lambda: self.quantized("int8"), cuda=True)
        self.row("--quantize fp8", lambda: self.quantized("fp8"), cuda=True)
        for family in ("qwen-image", "z-image"):  # the reference design's quantized rows
            self.row(f"--quantize fp8 {family}", lambda f=family: self.quantized("fp8", f), cuda=True)
        self.row("--offload model", lambda: self.offloaded("model"), cuda=True)
        self.row("--offload group", lambda: self.offloaded("group"), cuda=True)
        self.row("decode 8 x 1024x1024 (SD3 VAE)", lambda: self.decode_peak("image"), cuda=True)
        self.row("decode a Wan clip 81x480x832", lambda: self.decode_peak("video"), cuda=True)
        self.row("decode 1024x1024, channels-last vs as loaded", self.decode_layout, cuda=True)
        self.row("plan broadcast, fault board", self.plan_broadcast)
        return 1 if any(row.status == "FAILED" for row in self.rows) else 0


def _png(side: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


async def _streams(base_url: str, body: dict, count: int) -> list[list[str]]:
    import aiohttp

    async def one(seed: int) -> list[str]:
        names = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{base_url}/v1/generations", json={**body, "seed": seed}) as resp,
        ):
            async for line in resp.content:
                if line.startswith(b"event: "):
                    names.append(line[7:].decode().strip())
        return names

    return await asyncio.gather(*(one(i) for i in range(count)))


def _http_image(base_url: str, side: int, steps: int, guidance: float) -> float:
    body = {
        "prompt": "a red circle",
        "size": f"{side}x{side}",
        "num_inference_steps": steps,
        "guidance_scale": guidance,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/images/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu for the structure only")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats where a row repeats")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device is visible (torch {torch.__version__}); --device cpu runs the "
              "structure only", file=sys.stderr)  # fmt: skip
        return 2
    print(f"{'check':<44} {'result':<8} {'time':>9}  found", flush=True)
    with tempfile.TemporaryDirectory(prefix="diffusiond-gpu-check-") as work:
        check = GpuCheck(args.device, Path(work), args.quick)
        code = check.run()
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in check.rows], indent=2))
    failed = [row.check for row in check.rows if row.status == "FAILED"]
    print(f"\n{len(check.rows)} rows: {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
