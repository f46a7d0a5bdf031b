"""`--compile` side by side in one process and one run: the same 8 requests (bundled model unless --model, held-out
captions or "a shape N", seeds 0-7) through the engine, eager and then with the transformer's blocks compiled
after the daemon's own warm-up; best of --repeats. Prints the warm-up time, the time per batch of 8, the speed-up
and the largest pixel difference from the eager images.

    python -m diffusiond.tools.compile [--model DIR] [--steps 16] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np


def run(adapter, prompts: list[str], steps: int, repeats: int, compiled: bool) -> tuple[float, float, list]:
    from diffusiond.daemon.app import warm_up_requests
    from diffusiond.engine.engine import Engine
    from diffusiond.models.params import SamplingParams

    async def main():
        engine = Engine(adapter, max_batch=len(prompts), batch_wait=0.3)
        await engine.start()
        try:
            t0 = time.perf_counter()
            for group in warm_up_requests(adapter.capabilities, compiled=compiled):
                for handle in [engine.add_request(p) for p in group]:
                    await handle.result()
            warm = time.perf_counter() - t0
            best, images = float("inf"), []
            for _ in range(repeats):
                requests = [SamplingParams(prompt=p, seed=i, num_inference_steps=steps) for i, p in enumerate(prompts)]
                t0 = time.perf_counter()
                handles = [engine.add_request(r) for r in requests]
                images = [(await h.result()).image for h in handles]
                best = min(best, time.perf_counter() - t0)
            return warm, best, images
        finally:
            await engine.stop()

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    from diffusiond.models.loading.loader import load_adapter

    torch.set_num_threads(args.threads)
    if args.model is None:
        from diffusiond.models.default import default_model
        from diffusiond.tools.demo.evaluate import eval_scenes

        model, prompts = default_model(), [s.caption for s in eval_scenes(8)]
    else:
        model, prompts = args.model, [f"a shape {i}" for i in range(8)]
    eager = run(load_adapter(model), prompts, args.steps, args.repeats, compiled=False)
    adapter = load_adapter(model)
    adapter.enable_compile()
    compiled = run(adapter, prompts, args.steps, args.repeats, compiled=True)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(eager[2], compiled[2], strict=True))
    print(f"eager:    warm-up {eager[0]:.1f} s, 8 requests x {args.steps} steps: {eager[1] * 1000:.0f} ms")
    print(f"compiled: warm-up {compiled[0]:.1f} s, 8 requests x {args.steps} steps: {compiled[1] * 1000:.0f} ms")
    print(f"speed-up {eager[1] / compiled[1]:.2f}x, largest pixel difference {diff:.2e}")


if __name__ == "__main__":
    main()
