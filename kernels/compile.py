"""`--compile`: torch.compile of a transformer's repeated blocks (regional compilation), with dynamic shapes.

Only the blocks are compiled (diffusers' `compile_repeated_blocks` idea: one block class compiled once serves all
its instances, so compile time does not grow with depth); the embeddings, the step cache's first-block logic and
the Ulysses hooks stay eager. `dynamic=True` makes batch rows and token counts symbolic, so a batch size or image
size seen for the first time does not recompile in the middle of a request. torch still specialises a dimension
of size 1, so the warm-up (daemon/app.py `warm_up_requests`) runs one row and several rows.

Inductor's caches live in `TORCHINDUCTOR_CACHE_DIR`; diffusiond points it at `<cache dir>/inductor`
(models/loading/setup.py, from models/default.py `cache_dir`) unless it is set, so a restart reuses compiled kernels
instead of recompiling (the default, under /tmp, does not survive a reboot or a service's private /tmp).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def use_cache_dir(path: str | Path) -> str:
    """Point inductor's on-disk caches at `path` unless TORCHINDUCTOR_CACHE_DIR is set; the directory in use. Call
    before the first compile."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        Path(path).mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_blocks(transformer: torch.nn.Module, names: tuple[str, ...] = ()) -> int:
    """Compile every repeated block of `transformer` in place (compiled at its first call); how many. `names`: the
    block classes, for transformers that do not name their own (`_repeated_blocks`)."""
    names = names or getattr(transformer, "_repeated_blocks", None)
    if not names:
        raise ValueError(f"--compile: no repeated blocks known for {type(transformer).__name__}")
    count = 0
    for module in transformer.modules():
        if type(module).__name__ in names:
            module.compile(dynamic=True)
            count += 1
    if not count:
        raise ValueError(f"--compile: {type(transformer).__name__} has none of its blocks {names}")
    return count
