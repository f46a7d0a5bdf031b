"""The model `diffusiond` serves when none is named: a checkpoint that needs no download.

That is the demo model shipped inside the package (`models/demo/weights`, a 64x64 text-to-image SD3 checkpoint
trained on procedural shape scenes; see models/demo/README.md). Only if that folder is missing (a stripped
install) does it fall back to a tiny random SD3 checkpoint, built on first use into the cache folder
(`$DIFFUSIOND_CACHE`, else `$XDG_CACHE_HOME/diffusiond`, else `~/.cache/diffusiond`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_NAME = "tiny-sd3"
SHIPPED = Path(__file__).parent / "demo" / "weights"


def cache_dir() -> Path:
    if os.environ.get("DIFFUSIOND_CACHE"):
        return Path(os.environ["DIFFUSIOND_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diffusiond"


def default_model() -> str:
    """Path of the shipped demo checkpoint; without it, of the tiny random checkpoint (`tiny_model`)."""
    if (SHIPPED / "model_index.json").is_file():
        return str(SHIPPED)
    return tiny_model()


def tiny_model() -> str:
    """Path of the tiny random checkpoint, built atomically on first use (a half-written folder is never used)."""
    from diffusiond.models.preview import write_preview_factors
    from diffusiond.models.tiny import build_tiny

    target = cache_dir() / DEFAULT_NAME
    if (target / "model_index.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
    try:
        build_tiny("sd3", staging)
        write_preview_factors(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model_index.json").is_file():  # not a concurrent builder winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
