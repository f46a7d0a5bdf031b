"""The diffusers baseline, in a clean process of its own (FACTS.md: a baseline inside our process is slowed the same
way our engine is, so comparing there flatters us).

    python -m diffusiond.bench.baseline '{"model": ..., "width": 256, ...}'   -> one JSON line on stdout

It does nothing but load the pipeline with `from_pretrained`, warm up, and time what a user of plain diffusers would
run: one `pipeline(...)` call per image, and one call with a batch of images. The image is turned into PNG bytes, as
a user saving it (and our HTTP answer) would. Also the bare batched transformer forward, the bound no server can beat.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import time

import msgspec

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


class Job(msgspec.Struct, frozen=True):
    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    threads: int
    batch: int = 8
    repeats: int = 5
    # Images for the sequential and batched throughput measurements (a multiple of `batch`).
    images: int = 16


class Result(msgspec.Struct):
    single_s: list[float]
    single_no_png_s: list[float]
    sequential_images_per_s: float
    batched_images_per_s: float
    # steps x one transformer forward over `batch` images (CFG rows included): images/s no server can beat.
    forward_bound_images_per_s: float
    torch_threads: int


def _run(job: Job) -> Result:
    import diffusers
    import torch

    torch.set_num_threads(job.threads)
    from diffusiond.models.loader import read_model_index

    index = read_model_index(job.model)
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(job.model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def call(indices: list[int], png: bool = True) -> None:
        out = pipe(
            prompt=[PROMPTS[i % len(PROMPTS)] for i in indices],
            width=job.width,
            height=job.height,
            num_inference_steps=job.steps,
            guidance_scale=job.guidance_scale,
            generator=[torch.Generator().manual_seed(i) for i in indices],
            output_type="pil" if png else "np",
        )
        if png:
            for image in out.images:
                image.save(io.BytesIO(), format="PNG")

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    call([0])
    call(list(range(job.batch)))
    single = [timed(lambda: call([0])) for _ in range(job.repeats)]
    single_np = [timed(lambda: call([0], png=False)) for _ in range(job.repeats)]
    sequential = timed(lambda: [call([i]) for i in range(job.images)])
    batched = timed(lambda: [call(list(range(i, i + job.batch))) for i in range(0, job.images, job.batch)])

    # The bare forward: the transformer alone, at the batch's rows, as the pipeline calls it.
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("kwargs", {k: v for k, v in kwargs.items()})

    hook = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    call(list(range(job.batch)), png=False)
    hook.remove()
    kwargs = captured["kwargs"]
    with torch.inference_mode():
        pipe.transformer(**kwargs)
        forward = statistics.median(timed(lambda: pipe.transformer(**kwargs)) for _ in range(job.repeats))
    return Result(
        single_s=single,
        single_no_png_s=single_np,
        sequential_images_per_s=job.images / sequential,
        batched_images_per_s=job.images / batched,
        forward_bound_images_per_s=job.batch / (forward * job.steps),
        torch_threads=torch.get_num_threads(),
    )


def run_baseline(job: Job) -> Result:
    """Runs the baseline in a fresh interpreter with the job's thread count, and returns what it measured."""
    env = {**os.environ, "OMP_NUM_THREADS": str(job.threads)}
    proc = subprocess.run(
        [sys.executable, "-m", "diffusiond.bench.baseline", msgspec.json.encode(job).decode()],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the diffusers baseline failed:\n{proc.stderr[-3000:]}")
    return msgspec.json.decode(proc.stdout.strip().splitlines()[-1], type=Result)


if __name__ == "__main__":
    result = _run(msgspec.json.decode(sys.argv[1], type=Job))
    print(json.dumps(msgspec.to_builtins(result)))
