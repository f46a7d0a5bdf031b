"""`diffusiond bench engine`: the engine against the bare diffusers pipeline on the same weights, side by side.

Both sides use the adapter's own pipeline object (same weights in memory), the same prompts, seeds, size and steps.
Latency samples alternate between the two sides so machine noise hits both alike. Reported as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

PROMPTS = [
    "a red circle at the top left on a blue background",
    "a small green square in the middle",
    "a large yellow triangle on a black background",
    "a white circle at the bottom right",
    "a photo of a cat",
    "a blue square on a white background",
    "a black triangle at the top",
    "a green circle on a yellow background",
]


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def bench_engine(args: argparse.Namespace) -> int:
    from diffusiond.daemon.cli import resolve_model
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.outputs import Completed
    from diffusiond.engine.request import SamplingParams
    from diffusiond.models.loader import load_adapter

    model = resolve_model(args.model)
    adapter = load_adapter(model, device=args.device, dtype=args.dtype)
    pipe = adapter.pipe
    width, height = args.size
    guidance = args.guidance_scale if args.guidance_scale is not None else adapter.capabilities.default_guidance

    def params(i: int) -> SamplingParams:
        return adapter.resolve(
            SamplingParams(
                prompt=PROMPTS[i % len(PROMPTS)],
                seed=i,
                width=width,
                height=height,
                num_inference_steps=args.steps,
                guidance_scale=guidance,
            )
        )

    def diffusers_call(indices: list[int]) -> None:
        ps = [params(i) for i in indices]
        pipe(
            prompt=[p.prompt for p in ps],
            width=width,
            height=height,
            num_inference_steps=args.steps,
            guidance_scale=guidance,
            generator=[torch.Generator().manual_seed(p.seed) for p in ps],
            output_type="np",
        )

    engine = Engine(adapter, max_batch=8)

    async def engine_run(n: int, concurrency: int) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                result = await engine.add_request(params(i)).result()
                assert isinstance(result, Completed), result

        await asyncio.gather(*(one(i) for i in range(n)))

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    print(
        f"model {model} ({adapter.capabilities.family}), {width}x{height}, {args.steps} steps, "
        f"guidance {guidance}, {torch.get_num_threads()} torch threads, device {args.device}"
    )
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(engine.start())
        try:
            # Warm-up both sides (allocator, oneDNN kernels for each batch size used below).
            diffusers_call([0])
            diffusers_call(list(range(8)))
            runner.run(engine_run(8, 8))

            lat_d, lat_e = [], []
            for _ in range(args.repeats):
                lat_d.append(timed(lambda: diffusers_call([0])))
                lat_e.append(timed(lambda: runner.run(engine_run(1, 1))))
            med_d, med_e = statistics.median(lat_d), statistics.median(lat_e)

            n = args.images
            seq = timed(lambda: [diffusers_call([i]) for i in range(n)])
            batched = timed(lambda: [diffusers_call(list(range(i, i + 8))) for i in range(0, n, 8)])
            rows = [("diffusers, one call per image", n / seq), ("diffusers, one call of 8 images", n / batched)]
            for c in (1, 4, 8):
                rows.append((f"engine, {c} concurrent", n / timed(lambda c=c: runner.run(engine_run(n, c)))))
        finally:
            runner.run(engine.stop())

    # The bare batched forward bound: steps x one transformer call at batch 8 (CFG doubles it), nothing else.
    states = adapter.prepare([_new(f"b{i}", params(i)) for i in range(8)])
    adapter.denoise(states)
    t_fwd = statistics.median(timed(lambda: adapter.denoise(states)) for _ in range(3))
    bound = 8 / (t_fwd * args.steps)

    base = rows[0][1]
    print(
        f"\nsingle request latency: diffusers {med_d * 1e3:.1f} ms, engine {med_e * 1e3:.1f} ms, "
        f"ratio engine/diffusers {med_e / med_d:.3f} (median of {args.repeats}, alternating)"
    )
    print(f"\n{'throughput':40s} {'images/s':>9s} {'vs sequential diffusers':>24s}")
    for name, ips in rows:
        print(f"{name:40s} {ips:9.2f} {ips / base:23.2f}x")
    print(f"{'bare batched forward of 8 (bound)':40s} {bound:9.2f} {bound / base:23.2f}x")
    engine8 = rows[-1][1]
    print(f"\nengine at 8 concurrent / diffusers one call of 8: {engine8 / rows[1][1]:.3f}")
    print(f"engine at 8 concurrent / bare batched forward bound: {engine8 / bound:.3f}")
    return 0


def _new(request_id, params):
    from diffusiond.engine.wire import NewRequest

    return NewRequest(request_id, params)
