"""`diffusiond bench`: benchmarks that print ratios measured side by side in one run.

    diffusiond bench spmd      plan broadcast cost with 2 ranks; 1 rank vs 2 ranks CFG-parallel
    diffusiond bench serve     drive a running daemon over HTTP: latency percentiles, images/s, time to first preview
    diffusiond bench compare   a daemon over HTTP vs a clean diffusers process on the same checkpoint
    diffusiond bench cache     a step cache's speed-up over HTTP against an uncached daemon, rounds alternated

The entry point (diffusiond/__main__.py) hands `bench` commands here; nothing the daemon runs imports this package.
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from diffusiond.bench import caches, compare, load, serve
    from diffusiond.daemon.cli import parse_size
    from diffusiond.daemon.serve_flags import add_log_args

    parser = argparse.ArgumentParser(
        prog="diffusiond", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    add_log_args(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured side by side in one run")
    kinds = bench.add_subparsers(dest="bench", required=True)

    spmd = kinds.add_parser("spmd", help="plan broadcast cost with 2 ranks; 1 rank vs 2 ranks CFG-parallel")
    spmd.add_argument("--model", help="checkpoint (default: the bundled default model)")
    spmd.add_argument("--size", type=parse_size, default=(64, 64))
    spmd.add_argument("--steps", type=int, default=8)
    spmd.add_argument("--images", type=int, default=32)
    spmd.add_argument("--plans", type=int, default=2000, help="broadcast rounds per plan kind")
    spmd.set_defaults(func=_spmd)

    driving = kinds.add_parser(
        "serve",
        help="drive a running daemon over HTTP: latency percentiles, images/s, time to first preview, SLO",
        description=serve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_args(driving)
    driving.set_defaults(func=serve.bench_serve)

    side_by_side = kinds.add_parser(
        "compare",
        help="a daemon over HTTP vs a clean diffusers process on the same checkpoint: ratios, and a plot",
        description=compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_args(side_by_side)
    side_by_side.set_defaults(func=compare.bench_compare)

    cached = kinds.add_parser(
        "cache",
        help="a step cache's speed-up over HTTP against an uncached daemon, rounds alternated; agreement (PSNR)",
        description=caches.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    caches.add_args(cached)
    cached.set_defaults(func=caches.bench_cache)

    loading = kinds.add_parser(
        "load",
        help="loading, peak RSS per rank and heals at real size vs a clean diffusers process (make-tiny --real-size)",
        description=load.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    load.add_args(loading)
    loading.set_defaults(func=load.bench_load)
    return parser


def _spmd(args: argparse.Namespace) -> int:
    from diffusiond.bench.spmd import bench_spmd
    from diffusiond.daemon.cli import quiet_libraries

    quiet_libraries()
    return bench_spmd(args)


def main(argv: list[str]) -> int:
    """`argv`: the whole command line after `diffusiond` (global flags, then `bench`, then its own)."""
    from diffusiond.daemon.logs import configure_logging, quiet_library_noise

    quiet_library_noise()
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    return args.func(args)
