"""`diffusiond` command line: serve, config, generate, make-tiny, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

# Bad flags, environment or config file (as argparse exits on bad flags).
EXIT_USAGE = 2


def configure_threads(threads: int | None) -> None:
    """Set torch's thread count on purpose: more threads than free cores slows torch down by 10x or more.
    Under torchrun, OMP_NUM_THREADS (1 per rank) wins unless --threads is given. And the memory a step frees is kept
    for the next one, not faulted in again each step (kernels/host.py `keep_freed_memory`)."""
    import torch

    from diffusiond.kernels.host import keep_freed_memory

    keep_freed_memory()

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
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 ... (default: cpu)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto: bfloat16 on a GPU, float32 on the CPU (default: auto)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS, else all cores)")
    from diffusiond.daemon.config import ATTENTION_CHOICES, QUANTIZE_CHOICES

    parser.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_CHOICES,
        help="attention kernel: auto = flash-attn on a CUDA device where it is installed, else sdpa (default: auto)",
    )
    parser.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE_CHOICES,
        help="quantize the transformer's linear layers with torchao: int8 weights, int8 weights and activations, "
        "or fp8 (CUDA, compute capability >= 8.9) (default: none)",
    )
    parser.add_argument(
        "--offload",
        default="none",
        choices=["none", "model", "group"],
        help="keep weights in CPU memory for a GPU smaller than the model: model = one stage's components on the GPU "
        "at a time, group = the transformer streamed layer by layer (default: none)",
    )
    parser.add_argument(
        "--scheduler-config",
        metavar="JSON",
        help="change settings of the checkpoint's scheduler, as a JSON object, e.g. '{\"shift\": 3.0}' (default: "
        "the checkpoint's)",
    )
    parser.add_argument(
        "--adapter",
        default="auto",
        choices=["auto", "generic"],
        help="auto = the pipeline's dedicated family, else the generic path; generic = the pipeline's own call, a "
        "step at a time (default: auto)",
    )


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from diffusiond.models.default import default_model

    return default_model()


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from diffusiond.models.preview import write_preview_factors
    from diffusiond.models.tiny import NO_PREVIEW_MAP, build_tiny
    from diffusiond.models.tiny.real import REAL_SIZE_FAMILIES, build_real_size

    if args.real_size:
        if args.family not in REAL_SIZE_FAMILIES:
            print(f"diffusiond make-tiny: error: --real-size is for {', '.join(REAL_SIZE_FAMILIES)}", file=sys.stderr)
            return EXIT_USAGE
        print(build_real_size(args.family, args.out, seed=args.seed))
        return 0
    out = build_tiny(args.family, args.out, seed=args.seed)
    if args.family not in NO_PREVIEW_MAP:  # the generic path reads a published map or fits its own at load
        write_preview_factors(out)
    print(out)
    return 0


def generate_setup(args: argparse.Namespace):
    """`generate`'s model setup, request and what checks it before anything loads (no torch): the checkpoint's
    declarations (its sizes, steps, guidance), the input files, the setup's rules. (setup, params), or the exit code
    after printing why."""
    from diffusiond.daemon.config import ConfigError
    from diffusiond.daemon.startup import scheduler_changes
    from diffusiond.models.declared import check_declared, read_declared
    from diffusiond.models.inputs import admit_image
    from diffusiond.models.loading.setup import ModelSetup, SetupError, check_setup
    from diffusiond.models.params import ParamError, params_from

    model = resolve_model(args.model)
    width, height = args.size or (None, None)
    files: dict[str, bytes | None] = {"image": None, "mask": None}
    for name in files:
        path = getattr(args, name)
        if path is None:
            continue
        try:
            files[name] = Path(path).read_bytes()
            admit_image(files[name], name)
        except OSError as exc:
            print(f"diffusiond generate: error: --{name}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ParamError as exc:
            return _refused(exc)
    # The flags are the parameters, by name (`--steps`: num_inference_steps), as HTTP bodies are.
    params = params_from(
        vars(args),
        {"steps": "num_inference_steps"},
        width=width,
        height=height,
        preview_every=args.preview_every if args.previews else 0,
        **files,
    )
    try:
        if Path(model).is_dir():  # what the checkpoint says it serves, before seconds of loading
            check_declared(read_declared(model), params)
    except ParamError as exc:
        return _refused(exc)
    try:
        setup = ModelSetup(
            model=model,
            device=args.device,
            dtype=args.dtype,
            attention=args.attention,
            quantize=args.quantize,
            offload=args.offload,
            scheduler_config=scheduler_changes(args.scheduler_config),
            adapter=args.adapter,
        )
        check_setup(setup)
    except (ConfigError, SetupError) as exc:
        print(f"diffusiond generate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return setup, params


async def _generate(args: argparse.Namespace, setup, params) -> int:
    from diffusiond.daemon.image_encoding import encode_image
    from diffusiond.engine.engine import Engine
    from diffusiond.engine.outputs import Cancelled, Completed, Failed, Preview, Progress
    from diffusiond.models.declared import unknown_words
    from diffusiond.models.loading.setup import build_adapter
    from diffusiond.models.params import ParamError

    fmt = {".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}.get(Path(args.out).suffix.lower(), "png")
    engine = Engine(lambda: build_adapter(setup), max_batch=1)  # loaded on the engine's step thread
    await engine.start()
    try:
        try:
            handle = engine.add_request(params)
        except ParamError as exc:
            return _refused(exc)
        if unknown := unknown_words(engine.adapter.capabilities.vocabulary, args.prompt):
            print(f"diffusiond generate: words the model does not know: {', '.join(unknown)}", file=sys.stderr)
        async for event in handle.events():
            if isinstance(event, Progress):
                print(f"step {event.step}/{event.total}", file=sys.stderr)
            elif isinstance(event, Preview):
                path = Path(args.previews, f"step{event.step:03d}.png")
                await asyncio.to_thread(_write, path, encode_image(event.image))
            elif isinstance(event, Completed) and engine.adapter.capabilities.layers:  # [layers, H, W, 4]
                out = Path(args.out)
                paths = [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(len(event.image))]
                for path, layer in zip(paths, event.image, strict=True):
                    await asyncio.to_thread(_write, path, encode_image(layer, fmt))
                print(f"{', '.join(map(str, paths))} (seed {event.seed}, one image per layer)")
                return 0
            elif isinstance(event, Completed) and event.image.ndim == 4:  # a video model's clip [F, H, W, 3]
                from diffusiond.daemon.video_encoding import encode_video

                video_fmt = "webp" if fmt == "webp" else "mp4"
                clip = await asyncio.to_thread(
                    encode_video, event.image, handle.params.fps or 16, video_fmt, None, event.audio
                )
                await asyncio.to_thread(_write, Path(args.out), clip.data)
                note = f", {clip.format}: {clip.fallback}" if clip.fallback else ""
                print(f"{args.out} (seed {event.seed}, {clip.num_frames} frames at {clip.fps} fps{note})")
                return 0
            elif isinstance(event, Completed):
                await asyncio.to_thread(_write, Path(args.out), encode_image(event.image, fmt))
                print(f"{args.out} (seed {event.seed})")
                return 0
            elif isinstance(event, Cancelled | Failed):
                print(f"request ended: {event}", file=sys.stderr)
                return 1
    finally:
        await engine.stop()
    return 1


def _refused(exc) -> int:
    flag = {
        "width": "--size",
        "height": "--size",
        "num_inference_steps": "--steps",
        "guidance_scale": "--guidance-scale",
    }
    print(
        f"diffusiond generate: error: {flag.get(exc.param, '--' + exc.param.replace('_', '-'))}: {exc}", file=sys.stderr
    )
    return EXIT_USAGE


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def cmd_generate(args: argparse.Namespace) -> int:
    checked = generate_setup(args)  # everything that needs no torch, first
    if isinstance(checked, int):
        return checked
    from diffusiond.models.loading.setup import SetupError, check_kernels

    try:
        check_kernels(checked[0])
    except SetupError as exc:
        print(f"diffusiond generate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_threads(args.threads)
    quiet_libraries()
    return run_async(_generate(args, *checked))


def run_async(coro) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without it
        return asyncio.run(coro)
    return uvloop.run(coro)


def _load_config(args: argparse.Namespace):
    """The effective ServeConfig (CLI > environment > file > defaults), or None after printing the error."""
    from diffusiond.daemon.config import ConfigError, load_config

    try:
        return load_config(vars(args), os.environ, getattr(args, "config", None))
    except ConfigError as exc:
        print(f"diffusiond {args.command}: error: {exc}", file=sys.stderr)
        return None


def cmd_serve(args: argparse.Namespace) -> int:
    loaded = _load_config(args)
    if loaded is None:
        return EXIT_USAGE
    from diffusiond.daemon.auth import exposure_warning
    from diffusiond.daemon.config import ConfigError
    from diffusiond.daemon.launch import worker_config
    from diffusiond.daemon.startup import check_serving
    from diffusiond.daemon.state_lock import StateDirBusy
    from diffusiond.models.loading.setup import SetupError, check_kernels

    config = worker_config(loaded[0])  # a worker of our launch runs the launcher's configuration

    try:
        setup = check_serving(config)  # before torch is imported
        # Before any rank starts or loads; the launcher counts this node's ranks, each rank itself only (its own
        # view of the GPUs may be one: daemon/ranks.py `cuda_device`).
        from diffusiond.daemon.startup import in_launched_group

        check_kernels(setup, ranks_here=1 if in_launched_group() else config.nproc)
        _lock_state_dir(config)
    except (ConfigError, SetupError, StateDirBusy) as exc:
        print(f"diffusiond serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from diffusiond.daemon.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    if (warning := exposure_warning(config)) is not None:
        logging.getLogger("diffusiond").warning(warning)
    code = _serve(config)
    # The last line of every run says how it ended (a service manager's journal shows it beside the exit status).
    logging.getLogger("diffusiond").info("exiting with code %d", code)
    from diffusiond.daemon.startup import in_launched_group

    if in_launched_group():  # a rank: gloo's threads must not meet the interpreter's finalization (`leave`)
        from diffusiond.daemon.ranks import leave

        leave(code)
    return code


def _lock_state_dir(config) -> None:
    """One daemon per --state-dir (daemon/state_lock.py), unless replicas share jobs through --state-url: taken by
    the process that lives as long as the daemon (not by the ranks of our own launcher, whose parent holds it)."""
    import os

    from diffusiond.daemon.launch import RANK_CONFIG_ENV
    from diffusiond.daemon.startup import in_launched_group
    from diffusiond.daemon.state_lock import lock_state_dir

    if config.state_dir is None or config.state_url is not None:
        return
    if in_launched_group() and (RANK_CONFIG_ENV in os.environ or os.environ.get("RANK") != "0"):
        return
    lock_state_dir(config.state_dir)


def _serve(config) -> int:
    from diffusiond.daemon.startup import in_launched_group

    if in_launched_group():  # a worker of torchrun or of our own launch below
        from diffusiond.daemon.launch import run_rank

        configure_threads(config.threads)
        quiet_libraries()
        return run_rank(config)
    if config.nproc > 1 or config.nnodes > 1:
        from diffusiond.daemon.launch import launch

        return launch(config)
    configure_threads(config.threads)
    quiet_libraries()
    from diffusiond.daemon.serve import serve

    return serve(config)


def cmd_config(args: argparse.Namespace) -> int:
    loaded = _load_config(args)
    if loaded is None:
        return EXIT_USAGE
    from diffusiond.daemon.config import to_json, to_toml

    config, sources = loaded
    print(to_json(config) if args.format == "json" else to_toml(config, sources), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from diffusiond.daemon.serve_flags import add_log_args, add_serve_args
    from diffusiond.models.tiny import FAMILIES

    parser = argparse.ArgumentParser(prog="diffusiond", description=__doc__)
    add_log_args(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="serve the HTTP API (OpenAI Images API, native SSE API)", argument_default=argparse.SUPPRESS
    )
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser(
        "config",
        help="print the effective serve configuration (flags, environment, file)",
        argument_default=argparse.SUPPRESS,
    )
    add_serve_args(config)
    config.add_argument("--format", choices=["toml", "json"], default="toml")
    config.set_defaults(func=cmd_config)

    gen = sub.add_parser(
        "generate",
        help="generate one image through the engine and write it to a file",
        description="Generate one image through the same engine the server runs, without a server. What the model "
        "does not serve (its sizes, steps, guidance) is refused before it loads.",
    )
    add_model_args(gen)
    gen.add_argument("prompt", help="what to draw")
    gen.add_argument("--negative-prompt", help="what to steer away from (models that take one)")
    gen.add_argument(
        "--out",
        default="out.png",
        help="file to write: .png, .jpg or .webp; video models: .mp4; layered models: one file per layer, "
        "out-0.png, out-1.png, ... (default: out.png)",
    )
    gen.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT (default: the model's)")
    gen.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    gen.add_argument("--num-frames", type=int, help="video models: frames of the clip (default: the model's)")
    gen.add_argument("--fps", type=int, help="video models: frames per second of the file (default: the model's)")
    gen.add_argument("--seed", type=int, help="the same seed and parameters give the same image (default: random)")
    gen.add_argument("--guidance-scale", type=float, help="classifier-free guidance (default: the model's)")
    gen.add_argument("--image", metavar="FILE", help="start from this image (image to image; families that take one)")
    gen.add_argument(
        "--strength",
        type=float,
        help="with --image: the share of the steps run from it (default: the family's, 0.6 or 0.3)",
    )
    gen.add_argument(
        "--mask", metavar="FILE", help="with --image: repaint only where this is white (transparent, with alpha)"
    )
    gen.add_argument("--previews", metavar="DIR", help="write intermediate previews into DIR")
    gen.add_argument("--preview-every", type=int, default=1, help="a preview every N steps (default: 1)")
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint (offline) for tests and development")
    tiny.add_argument("--family", required=True, choices=FAMILIES)
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--real-size",
        action="store_true",
        help="the family's real transformer and VAE (random weights, bf16, gigabytes), tiny text encoders: for "
        "measuring loading, memory and heals at real size (models/tiny/real.py lists the families)",
    )
    tiny.set_defaults(func=cmd_make_tiny)

    # `diffusiond bench ...` never reaches this parser: the entry point (diffusiond/__main__.py) hands it to
    # diffusiond.bench.cli, so serving never imports the benchmarks. Listed here for `diffusiond --help`.
    sub.add_parser("bench", help="benchmarks that print ratios measured side by side in one run (diffusiond bench -h)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from diffusiond.daemon.logs import quiet_library_noise

    quiet_library_noise()
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        print(
            "diffusiond: error: run benchmarks as `diffusiond bench ...` (python -m diffusiond bench ...)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.command not in ("serve", "config"):  # those two take logging from their configuration
        from diffusiond.daemon.logs import configure_logging

        configure_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    return args.func(args)
