"""`diffusiond` command line: generate, make-tiny, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path


def configure_threads(threads: int | None) -> None:
    """Set torch's thread count on purpose: more threads than free cores slows torch down by 10x or more.
    Under torchrun, OMP_NUM_THREADS (1 per rank) wins unless --threads is given."""
    import torch

    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))


def quiet_libraries() -> None:
    """No progress bars in daemon logs."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 256x256, got {text!r}") from None
    return width, height


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="diffusers checkpoint folder or hub id (default: the bundled default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS, else all cores)")


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from diffusiond.models.default import default_model

    return default_model()


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from diffusiond.models.preview import write_preview_factors
    from diffusiond.models.tiny import build_tiny

    out = build_tiny(args.family, args.out, seed=args.seed)
    write_preview_factors(out)
    print(out)
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from diffusiond.daemon.images import encode_image
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.outputs import Cancelled, Completed, Failed, Preview, Progress
    from diffusiond.engine.request import SamplingParams
    from diffusiond.models.loader import load_adapter

    adapter = await asyncio.to_thread(load_adapter, resolve_model(args.model), device=args.device, dtype=args.dtype)
    width, height = args.size or (None, None)
    params = SamplingParams(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        width=width,
        height=height,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        preview_every=args.preview_every if args.previews else 0,
    )
    engine = Engine(adapter, max_batch=1)
    await engine.start()
    try:
        handle = engine.add_request(params)
        async for event in handle.events():
            if isinstance(event, Progress):
                print(f"step {event.step}/{event.total}", file=sys.stderr)
            elif isinstance(event, Preview):
                path = Path(args.previews, f"step{event.step:03d}.png")
                await asyncio.to_thread(_write, path, encode_image(event.image))
            elif isinstance(event, Completed):
                await asyncio.to_thread(_write, Path(args.out), encode_image(event.image))
                print(f"{args.out} (seed {event.seed})")
                return 0
            elif isinstance(event, Cancelled | Failed):
                print(f"request ended: {event}", file=sys.stderr)
                return 1
    finally:
        await engine.stop()
    return 1


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def cmd_generate(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    quiet_libraries()
    return run_async(_generate(args))


def run_async(coro) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without it
        return asyncio.run(coro)
    return uvloop.run(coro)


def cmd_bench(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    quiet_libraries()
    from diffusiond.daemon.bench import bench_engine

    return bench_engine(args)


def cmd_serve(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    quiet_libraries()
    from aiohttp import web

    from diffusiond.daemon.app import create_app
    from diffusiond.daemon.config import ServeConfig

    config = ServeConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("DIFFUSIOND_API_KEY") or None,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        device=args.device,
        dtype=args.dtype,
    )
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its request.
    web.run_app(
        create_app(config),
        host=config.host,
        port=config.port,
        loop=loop,
        handler_cancellation=True,
        print=lambda msg: logging.getLogger("diffusiond").info(msg),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusiond", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one object per line")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the HTTP API (OpenAI Images API, native SSE API)")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set DIFFUSIOND_API_KEY)")
    serve.add_argument("--max-batch", type=int, default=8, help="requests per batched forward")
    serve.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate one image through the engine and write it to a file")
    add_model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--negative-prompt")
    gen.add_argument("--out", default="out.png")
    gen.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT (default: the model's)")
    gen.add_argument("--steps", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--guidance-scale", type=float)
    gen.add_argument("--previews", metavar="DIR", help="write intermediate previews into DIR")
    gen.add_argument("--preview-every", type=int, default=1)
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint (offline) for tests and development")
    tiny.add_argument("--family", required=True, choices=["sd3", "flux"])
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)

    bench = sub.add_parser("bench", help="benchmarks that print ratios measured side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="diffusers pipeline calls vs the engine at 1, 4 and 8 requests")
    add_model_args(engine)
    engine.add_argument("--size", type=parse_size, default=(256, 256))
    engine.add_argument("--steps", type=int, default=8)
    engine.add_argument("--images", type=int, default=16, help="images per throughput measurement")
    engine.add_argument("--repeats", type=int, default=5, help="single-request latency samples per side")
    engine.add_argument("--guidance-scale", type=float, default=None)
    engine.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from diffusiond.daemon.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
