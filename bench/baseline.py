"""The diffusers baseline, in a clean process of its own (FACTS.md: a baseline inside our process is slowed the same
way our engine is, so comparing there flatters us).

The child loads the pipeline with `from_pretrained`, warms up, and then waits for commands on stdin, one JSON result
per line on stdout, so that a benchmark can alternate it with the daemon request by request (drift on a noisy
machine then hits both sides alike; the side that waits is idle). It runs what a user of plain diffusers would run:
`pipeline(...)` per image or per batch of images, each image saved as PNG bytes (as a user saving it, and as our HTTP
answer); `single_np` is the call alone. `forward` times the bare batched transformer forward: the bound.

    single | single_np | sequential N | batched N | forward | quit
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
    device: str = "cpu"
    dtype: str = "float32"


class Baseline:
    """The parent's handle on the child process."""

    def __init__(self, job: Job) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(job.threads)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diffusiond.bench.baseline", msgspec.json.encode(job).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._read()  # "ready" after loading and warming up

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the diffusers baseline failed:\n{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def run(self, command: str) -> float:
        """Seconds the command took in the child."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return float(self._read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()

    def __enter__(self) -> Baseline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(job: Job) -> None:
    import diffusers
    import torch

    torch.set_num_threads(job.threads)
    from diffusiond.models.loading.pipelines import null_components
    from diffusiond.models.loading.registry import read_model_index

    index = read_model_index(job.model)
    # Components saved as None (SD3 without T5) are passed as None, as a user of such a checkpoint must.
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(
        job.model, dtype=getattr(torch, job.dtype), **null_components(job.model)
    )
    pipe.to(job.device)
    pipe.set_progress_bar_config(disable=True)
    seeds = iter(range(10**9))

    def call(n: int, png: bool = True) -> None:
        indices = [next(seeds) for _ in range(n)]
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

    # The bare forward: the denoiser alone (a transformer, or a UNet), with the inputs the pipeline gives it for a
    # batch.
    denoiser = getattr(pipe, "transformer", None) or pipe.unet
    captured = {}

    def grab(module, args, kwargs) -> None:
        captured.setdefault("call", (tuple(args), dict(kwargs)))

    hook = denoiser.register_forward_pre_hook(grab, with_kwargs=True)
    call(job.batch, png=False)
    hook.remove()
    call(1)

    def forward() -> None:
        args, kwargs = captured["call"]
        with torch.inference_mode():
            denoiser(*args, **kwargs)

    commands = {
        "single": lambda: call(1),
        "single_np": lambda: call(1, png=False),
        "batched": lambda n: [call(job.batch) for _ in range(n // job.batch)],
        "sequential": lambda n: [call(1) for _ in range(n)],
        "forward": forward,
    }
    print('"ready"', flush=True)
    for line in sys.stdin:
        name, *arg = line.split()
        if name == "quit":
            return
        t0 = time.perf_counter()
        commands[name](*map(int, arg))
        print(json.dumps(time.perf_counter() - t0), flush=True)


def median_forward(baseline: Baseline, repeats: int = 5) -> float:
    baseline.run("forward")
    return statistics.median(baseline.run("forward") for _ in range(repeats))


if __name__ == "__main__":
    _child(msgspec.json.decode(sys.argv[1], type=Job))
