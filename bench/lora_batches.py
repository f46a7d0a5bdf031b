"""LoRA per request, side by side in one process and one run: the per-step cost (one batched forward) of a batch of
requests with 0, 1, 4 and B distinct adapters, against the same batch without LoRA. Rounds interleave the
configurations (none, 1, 4, B, none, ...) so that machine noise hits all alike; medians are printed with their ratio
to the batch without LoRA.

The adapters are random, in diffusers' format (models/tiny/lora.py: every attention projection), for the bundled
default model unless --model names another checkpoint.

    python -m diffusiond.bench.lora_batches [--model DIR] [--batch 8] [--rank 16] [--rounds 15] [--size 64x64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from diffusiond.models.default import default_model
    from diffusiond.models.loading.loader import load_adapter
    from diffusiond.models.params import LoraChoice, SamplingParams
    from diffusiond.models.tiny.lora import build_tiny_lora

    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    width, height = (int(x) for x in args.size.split("x"))
    adapter = load_adapter(model)
    registry = adapter.enable_lora(64 << 30)
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.batch):
            path = build_tiny_lora(model, Path(folder) / f"l{i}.safetensors", seed=i + 1, rank=args.rank, alpha=16)
            registry.register(f"l{i}", str(path))
    b = args.batch
    configurations = {"no LoRA": [None] * b, "1 adapter": [0] * b, "4 adapters": [i % 4 for i in range(b)]}
    configurations[f"{b} adapters"] = list(range(b))

    def states_for(choice: list[int | None]):
        params = [
            adapter.resolve(
                SamplingParams(
                    prompt=f"a small red circle {i}",
                    seed=i,
                    width=width,
                    height=height,
                    num_inference_steps=20,
                    lora=(LoraChoice(f"l{c}", 1.0),) if c is not None else None,
                )
            )
            for i, c in enumerate(choice)
        ]
        states = adapter.prepare([(f"r{i}", p) for i, p in enumerate(params)])
        for state in states:
            if state.params.lora:
                state.lora = registry.acquire(state.params.lora, state)
        return states

    batches = {name: states_for(choice) for name, choice in configurations.items()}
    times: dict[str, list[float]] = {name: [] for name in batches}
    with torch.inference_mode():
        for states in batches.values():  # warm-up
            adapter.denoise(states)
        for _ in range(args.rounds):
            for name, states in batches.items():
                t0 = time.perf_counter()
                adapter.denoise(states)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["no LoRA"])
    layers = len(registry.entries["l0"].lora.layers) if registry.entries["l0"].lora else 0
    name = adapter.capabilities.name or Path(model).name
    print(
        f"{name}: batch of {b} at {width}x{height}, LoRA rank {args.rank} on {layers} linears, "
        f"{args.threads} threads, median of {args.rounds} forwards"
    )
    for label, samples in times.items():
        median = statistics.median(samples)
        print(f"  {label:12s} {median * 1000:8.2f} ms/step  {median / base:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
