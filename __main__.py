"""The `diffusiond` command: `bench ...` runs the benchmarks (diffusiond.bench), everything else the daemon's own
commands (diffusiond.daemon.cli). The one place that imports the benchmarks, and only when asked to."""

from __future__ import annotations

import sys

# Flags before the command, each with a value (daemon/serve_flags.py `add_log_args`).
GLOBAL_FLAGS = ("--log-level", "--log-format")


def command(argv: list[str]) -> str | None:
    """The command word of `argv`: the first argument that is neither a global flag nor its value."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in GLOBAL_FLAGS else 1
    return argv[i] if i < len(argv) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if command(argv) == "bench":
        from diffusiond.bench.cli import main as bench

        return bench(argv)
    from diffusiond.daemon.cli import main as daemon

    return daemon(argv)


if __name__ == "__main__":
    raise SystemExit(main())
