"""The step cache as a model holds it: the server's method (`--cache`, "none" by default) and its settings, what a
request that sends no `cache_threshold` or `cache_steps` gets, and the forward that runs a batch through it.

A family's adapter holds one (`FlowMatchAdapter.cache`) and hands it what differs per family: its plain transformer
call and, where it implements step caching, its cached forward (models/stepcache/forwards.py). Request resolution
asks it for a request's fields (`request_fields`); the parallel wiring runs each transformer call through it
(`forward`): a request's threshold walks from its parameters to `core.reuse` in one direction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.stepcache import core, methods
from diffusiond.models.stepcache.settings import (
    IDENTITY,
    METHODS,
    QUALITY_PRESETS,
    load_calibration,
    quality_level,
    scm_steps,
)

log = logging.getLogger(__name__)

# (batched, shared) -> the transformer's output over those rows.
Call = Callable[[dict[str, Any], dict[str, Any]], torch.Tensor]
# (method, batched, shared, rows, states) -> the output, each request's blocks reused or computed.
Cached = Callable[[methods.Method, dict[str, Any], dict[str, Any], int, Sequence[Any]], torch.Tensor]


class StepCache:
    """`offered`: the methods the family implements (its declaration). `call`: the plain transformer call;
    `cached`: the family's cached forward (None where it implements none); `teacache`: TeaCache's polynomial where
    the checkpoint has no calibration of its own; `magcache`: MagCache's ratios likewise (None: none known)."""

    def __init__(
        self,
        family: str,
        offered: tuple[str, ...],
        call: Call,
        cached: Cached | None = None,
        *,
        teacache: tuple[float, ...] = IDENTITY,
        magcache: tuple[float, ...] | None = None,
    ) -> None:
        self.family, self.offered = family, offered
        self.call, self.cached = call, cached
        self.teacache, self.magcache = teacache, magcache
        self.name = "none"
        self.method: methods.Method | None = None
        # What requests that send none get: the server's threshold and SCM steps (`--cache-config`'s "scm").
        self.threshold = 0.0
        self.steps: Any = None

    @property
    def on(self) -> bool:
        return self.name != "none"

    def enable(
        self,
        name: str,
        threshold: float,
        config: dict[str, Any] | None,
        *,
        blocks: int,
        source: str | None,
        stochastic: bool,
    ) -> None:
        """Server-wide: the method, the threshold of requests that send none and `--cache-config`'s settings, for a
        transformer of `blocks` blocks; `source`: the checkpoint's folder (its calibration), None for a hub id;
        `stochastic`: whether its sampler draws fresh noise at every step."""
        if name not in METHODS:
            raise ValueError(f"unknown cache method {name!r}; choose from {', '.join(METHODS)}")
        if name != "none" and (name not in self.offered or self.cached is None):
            raise ValueError(f"--cache {name} is not implemented for the {self.family} family yet")
        if name not in ("none", "x0cache") and stochastic:  # x0cache reads what stays smooth under the noise
            log.warning(
                "--cache %s: the scheduler samples with fresh noise at every step (stochastic_sampling), so the "
                "blocks' input changes too much between steps to reuse their residuals; to sample deterministically, "
                "add --scheduler-config '{\"stochastic_sampling\": false}'",
                name,
            )
        coefficients, ratios = load_calibration(source) if source is not None else (None, None)
        coefficients = coefficients or self.teacache
        self.method = core.method_of(name, config or {}, blocks, coefficients, ratios or self.magcache)
        self.name = name
        self.threshold = threshold if name != "none" else 0.0
        self.steps = (config or {}).get("scm")

    def request_fields(self, params: SamplingParams, steps: int) -> dict[str, Any]:
        """A request's resolved `cache_threshold`, `cache_steps` and `quality` (the preset applied) (ParamError naming
        one this server cannot use)."""
        level = None if params.quality is None else quality_level(params.quality)
        threshold = self._threshold(params, level)
        if level is not None and (not self.on or params.cache_threshold is not None):
            level = "lossless" if threshold == 0 else None  # what was applied: no preset (exact, or its threshold)
        return {"cache_threshold": threshold, "cache_steps": self._steps(params, steps), "quality": level}

    def _threshold(self, params: SamplingParams, level: str | None) -> float:
        if params.cache_threshold is None:
            if level is not None:  # a preset: a multiple of the server's threshold (0 without a step cache)
                return min(10.0, self.threshold * QUALITY_PRESETS[level])
            return self.threshold
        if params.cache_threshold > 0 and not self.on:
            raise ParamError("cache_threshold", "this server runs without step caching (start it with --cache)")
        return params.cache_threshold

    def _steps(self, params: SamplingParams, steps: int) -> tuple[int, ...] | None:
        """The steps that compute whatever the cache's signal, as indices (None: no mask)."""
        if params.cache_steps is None:
            if not self.on or self.steps is None:
                return None
            return scm_steps(self.steps, steps)  # a list for other step counts: its steps that exist
        if not self.on:
            raise ParamError("cache_steps", "this server runs without step caching (start it with --cache)")
        if not isinstance(params.cache_steps, str) and max(params.cache_steps, default=0) >= steps:
            raise ParamError(
                "cache_steps", f"step {max(params.cache_steps)} is past the request's {steps} steps (0 is the first)"
            )
        return scm_steps(params.cache_steps, steps)

    def forward(
        self, batched: dict[str, Any], shared: dict[str, Any], rows: int, states: Sequence[Any]
    ) -> torch.Tensor:
        """One transformer call over this rank's rows (`rows` per request of `states`): the cached forward when
        step caching is on, else the plain call."""
        if self.method is not None and self.cached is not None and self.on:
            return self.cached(self.method, batched, shared, rows, states)
        return self.call(batched, shared)
