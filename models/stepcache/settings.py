"""The step caches' settings, readable without torch: the methods, what `--cache-config` may set for each (checked
at start, models/loading/setup.py), the threshold of requests that send none, and the calibration a checkpoint may
carry beside its weights (tools/calibrate.py). The methods themselves: models/stepcache/methods.py; the server's
cache as an adapter holds it: models/stepcache/cache.py."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import msgspec

# Every method a server may run (`--cache`); "none" runs none.
CACHES = ("fbcache", "teacache", "dbcache", "x0cache", "magcache")
METHODS = ("none", *CACHES)

# What `--cache-config` may set for each method: each setting's default, least and greatest value (None: no bound); a
# setting whose default is a bool takes true or false.
CACHE_SETTINGS: dict[str, dict[str, tuple[int | float, int, int | None]]] = {
    "dbcache": {
        "fn": (1, 1, None),
        "bn": (0, 0, None),
        "warmup": (0, 0, None),
        "taylorseer": (False, 0, None),
        "taylorseer_order": (1, 1, 2),
    },
    "x0cache": {"max_run": (1, 1, None)},
    # MagCache: the most steps reused in a row (its K), the share of first steps that always compute; and "ratios",
    # the checkpoint's magnitude ratios per step (below; else its calibration, tools/calibrate.py).
    "magcache": {"max_skip": (3, 1, None), "retention": (0.2, 0, 1)},
}
# Every method also takes "scm": the steps that always compute for requests that send no cache_steps (a preset name
# or step indices, as models/params.py CacheSteps).

# The threshold of requests that send none, where the server sets none. x0cache's is higher: it thresholds another
# quantity (the change of a request's predicted clean image per step), and reuses at most one step in a row, so past
# 0.2 a higher threshold reuses wherever that allows without moving the images. Measured on the bundled model as
# shipped (stochastic sampler, 20 steps, docs/acceleration.md), whole requests over HTTP against an uncached daemon
# (bench cache): 0.2 1.50x, 0.3 1.55x, 0.5 1.61x, all at 35.7-36.2 dB; in the engine (tools.accel) 0.2 1.53x and
# 0.5 1.69x, both 39.9 dB, the judge 96.9% and 93.8% against the exact images' 95.3%.
DEFAULT_CACHE_THRESHOLD = 0.1
CACHE_THRESHOLDS = {"x0cache": 0.5}

# Per-request quality presets, as multiples of the threshold of requests that send none (the server's: "balanced").
QUALITY_PRESETS = {"lossless": 0.0, "high": 0.25, "balanced": 1.0, "fast": 2.0}
QUALITY_ALIASES = {"auto": "balanced", "medium": "balanced", "standard": "balanced", "hd": "high", "low": "fast"}


def quality_level(word: str) -> str:
    """A request's `quality` as one of QUALITY_PRESETS: its own name, OpenAI's (`QUALITY_ALIASES`), or for a word
    neither knows (a later API's), the nearest by what it says: more than high ("xhigh", "ultra", "max", "best") is
    lossless, anything high "high", anything low or fast "fast", the rest balanced."""
    word = word.strip().lower()
    if word in QUALITY_PRESETS:
        return word
    if word in QUALITY_ALIASES:
        return QUALITY_ALIASES[word]
    if word.endswith("high"):
        return "lossless"  # xhigh, ultrahigh, ...: more than high
    if any(w in word for w in ("low", "fast", "draft", "min", "cheap")):
        return "fast"
    if any(w in word for w in ("ultra", "max", "best", "lossless", "exact")):
        return "lossless"
    return "balanced"


# TeaCache's polynomial and MagCache's ratios fitted for a checkpoint (tools/calibrate.py), beside its weights.
CACHE_FILE = "diffusiond_cache.json"
# TeaCache's published rescaling polynomial for FLUX.1 (highest degree first): a fact of those weights.
FLUX_TEACACHE = (498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861)
IDENTITY = (1.0, 0.0)


def default_cache_threshold(method: str) -> float:
    return CACHE_THRESHOLDS.get(method, DEFAULT_CACHE_THRESHOLD)


def check_cache_config(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """`--cache-config`'s settings for `--cache NAME`, defaults filled in; ValueError naming an unknown key or a bad
    value (what needs the model, the blocks left to reuse, is checked by models/stepcache/methods.py `method_of`)."""
    allowed = CACHE_SETTINGS.get(name, {})
    extra = {"scm", "ratios"} if name == "magcache" else {"scm"} if name in CACHES else set()
    unknown = sorted(set(config) - set(allowed) - extra)
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        raise ValueError(f"--cache-config: {', '.join(map(repr, unknown))} unknown to --cache {name} ({takes})")
    out: dict[str, Any] = {}
    for key, (default, least, most) in allowed.items():
        value = config.get(key, default)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"--cache-config: {key} must be true or false, not {value!r}")
        elif isinstance(default, float):
            if not isinstance(value, int | float) or isinstance(value, bool) or not least <= value <= (most or 0):
                raise ValueError(f"--cache-config: {key} must be a number from {least} to {most}, not {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < least or (most and value > most):
            within = f">= {least}" if most is None else f"from {least} to {most}"
            raise ValueError(f"--cache-config: {key} must be an integer {within}, not {value!r}")
        out[key] = value
    if "scm" in config:
        out["scm"] = _scm(config["scm"])
    if "ratios" in config:
        ratios = config["ratios"]
        if not isinstance(ratios, list) or not ratios or not all(_positive(r) for r in ratios):
            raise ValueError(f"--cache-config: ratios must be a non-empty list of positive numbers, not {ratios!r}")
        out["ratios"] = tuple(float(r) for r in ratios)
    if "taylorseer_order" in config and not out.get("taylorseer"):
        raise ValueError('--cache-config: taylorseer_order is set but TaylorSeer is off (add "taylorseer": true)')
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def _scm(value: Any) -> Any:
    from diffusiond.models.params import CacheSteps

    try:
        return msgspec.convert(value, CacheSteps)
    except msgspec.ValidationError:
        raise ValueError(
            '--cache-config: scm must be "fast", "medium", "slow", "off" or a list of step indices (0 is the first), '
            f"not {value!r}"
        ) from None


def load_calibration(source: str) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """What tools/calibrate.py measured for the checkpoint in `source`: TeaCache's polynomial (highest degree first)
    and MagCache's magnitude ratios per step, each None where it measured none."""
    path = os.path.join(source, CACHE_FILE)
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        fitted = json.load(f)
    coefficients = _numbers(path, fitted, "teacache", "coefficients", "finite", math.isfinite)
    ratios = _numbers(path, fitted, "magcache", "ratios", "positive", lambda r: 0 < r < math.inf)
    return coefficients, ratios


def _numbers(path: str, fitted: dict, method: str, key: str, kind: str, ok: Any) -> tuple[float, ...] | None:
    if method not in fitted:
        return None
    values = fitted[method][key]
    if not values or not all(isinstance(v, int | float) and ok(v) for v in values):
        raise ValueError(f"{path}: {method} {key} must be a non-empty list of {kind} numbers")
    return tuple(float(v) for v in values)


# SCM presets: Cache-DiT's step computation masks for 28 steps ("slow", "medium", "fast": 18, 15 and 11 of them
# compute), as runs of computed and reused steps.
SCM_RUNS = {
    "slow": ((8, 3, 3, 2, 1, 1), (1, 2, 2, 2, 3)),
    "medium": ((6, 2, 2, 2, 2, 1), (1, 3, 3, 3, 3)),
    "fast": ((6, 1, 1, 1, 1, 1), (1, 3, 4, 5, 4)),
}


def _runs(pattern: list[bool]) -> list[tuple[int, int]]:
    """The first and last index of each run of True in `pattern`."""
    runs: list[tuple[int, int]] = []
    for j, on in enumerate(pattern):
        if on and (j == 0 or not pattern[j - 1]):
            runs.append((j, j))
        elif on:
            runs[-1] = (runs[-1][0], j)
    return runs


def scm_steps(mask: str | Sequence[int], steps: int) -> tuple[int, ...] | None:
    """The steps of a request of `steps` steps that compute whatever its cache's signal says: a preset's 28-step
    mask stretched to `steps`, or the listed indices that exist; with the first and the last, which always compute
    (`reuse`). "off": None, no mask."""
    if mask == "off":
        return None
    if isinstance(mask, str):
        computed, reused = SCM_RUNS[mask]
        pattern: list[bool] = []
        for c, r in zip(computed, (*reused, 0), strict=True):
            pattern += [True] * c + [False] * r
        n = len(pattern)
        # Step i computes where the mask's step under its middle does; a run of the mask's computed steps that no
        # middle falls in (fewer steps than the mask's) still gets the step it starts in.
        middle = [(2 * i + 1) * n // (2 * steps) for i in range(steps)]
        stretched = {i for i in range(steps) if pattern[middle[i]]}
        for start, end in _runs(pattern):
            if not any(start <= middle[i] <= end for i in stretched):
                stretched.add(start * steps // n)
        return tuple(sorted(stretched | {0, steps - 1}))
    return tuple(sorted({i for i in mask if i < steps} | {0, steps - 1}))
