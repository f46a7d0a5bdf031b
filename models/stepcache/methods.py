"""Step caching with a decision per request, inside a batched forward: first-block cache, DBCache and TeaCache.

Cache methods elsewhere (diffusers' `first_block_cache` hook, Cache-DiT, TeaCache) decide once for the whole batch
tensor: in a batch that mixes requests at different steps, with different thresholds or none, that decision is
wrong for most of them. Here every request decides alone, from a change signal of its own rows against its own
previous step:

- **fbcache** (first-block cache): the first transformer block runs for every row; the signal is the relative L1
  change `mean|r - r_prev| / mean|r_prev|` of the first block's residual (output - input) since the request's last
  fully computed step. Reusing skips the remaining blocks: the request adds the residual they added then.
- **dbcache** (Cache-DiT's dual block cache; fbcache is its Fn=1, Bn=0): the first `fn` blocks run for every row and
  their residual is the signal; the last `bn` blocks also run for every row, so a reusing request only skips the
  middle ones (it adds their image and text residuals of its last computed step, then the last blocks refine that);
  no request reuses before step `warmup`. Set per server with `--cache-config '{"fn": 2, "bn": 1, "warmup": 4}'`.
  With `"taylorseer": true` a reusing request adds, instead of the span's last residuals, their Taylor forecast
  (TaylorSeer) at this step from its own last computed steps: the residuals' finite differences per step, up to
  `taylorseer_order` (1 or 2), kept on its cache.
- **teacache**: only the first block's timestep-modulated input (`norm1(h, temb)`) is computed for every row; the
  signal is its relative L1 change since the previous step, rescaled by the family's polynomial (`Method.rescale`:
  FLUX's published coefficients, or a fit beside the weights by `tools/calibrate.py`) and
  accumulated over the steps the request reused. Reusing skips every block: the request adds the residual all blocks
  added at its last computed step; computing resets the accumulator.

- **x0cache**: decides before anything runs, from the request's own history: the relative change of its predicted
  clean image (`x0 = x - sigma * v`, flow matching) between its last two computed steps, per step, times the steps
  since the last computed one. Reusing skips every block, and the request's output is the one that predicts that
  same clean image from this step's input (`v = (x - x0) / sigma`): the sampler holds its clean image for the step.
  At most `max_run` steps in a row reuse (`--cache-config '{"max_run": 2}'`; default 1).
  What it reads stays smooth under samplers that add fresh noise at every step (the bundled model's), where the
  blocks' input and residuals do not.

In all of them, a request's change is measured over its rows (both CFG rows: one decision per request, residuals per
row). Below the request's threshold it reuses; at or above it (and always at its first and last step, and with threshold
0) its rows go through the blocks in a sub-batch of the requests that compute, and its cache is renewed. State lives
on the request's `RequestState.cache` and goes with it. Exactness: with threshold 0 every row computes, through the
same blocks in the same order as the pipeline's forward (tests compare with diffusers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusiond.models.stepcache.core import (
    Batch,
    Method,
    RequestCache,
    changes,
    fit,
    relative_l1,
    reuse,
    run_blocks,
    signals,
)


def cached_blocks(method: Method, blocks: Sequence[Any], batch: Batch, modulated: Any = None) -> torch.Tensor:
    """The transformer's blocks over `batch` with a decision per request: image tokens after the last block
    [B * rows, S, D]. Every block takes (hidden_states, encoder_hidden_states, temb, **block_kwargs) and returns
    (encoder_hidden_states, hidden_states), as diffusers' SD3 and FLUX blocks do. `modulated`: how the first block
    modulates its input, for TeaCache (default: its `norm1`)."""
    if method.name == "teacache":
        return _teacache(method, blocks, batch, modulated or _modulated_input)
    if method.name == "x0cache":
        return _x0cache(method, blocks, batch)
    if method.name == "magcache":
        return _magcache(method, blocks, batch)
    return _dbcache(method, blocks, batch)


def magnitude_ratio(method: Method, step: int, steps: int) -> float:
    """The checkpoint's magnitude ratio at `step` of a request of `steps` steps: the calibration's step nearest in
    the schedule (as diffusers' `nearest_interp`)."""
    ratios = method.ratios
    if steps <= 1:
        return ratios[-1]
    return ratios[round(step * (len(ratios) - 1) / (steps - 1))]


def _magcache(method: Method, blocks: Sequence[Any], batch: Batch) -> torch.Tensor:
    """MagCache (diffusers' `MagCacheConfig` rule, per request): after the first `retention` share of its steps, a
    request multiplies the checkpoint's magnitude ratios of the steps since it last computed and adds |1 - product|
    to its error; below its threshold, at most `max_skip` steps in a row, it runs no block and adds the residual
    every block added at its last computed step. The decision reads no tensor: every rank makes it alike."""
    states = batch.states
    computing: list[int] = []
    reusing: list[int] = []
    for i, state in enumerate(states):
        cache, error = state.cache, None
        if cache is not None and state.step_index >= int(method.retention * state.total_steps + 0.5):
            cache.magnitude *= magnitude_ratio(method, state.step_index, state.total_steps)
            cache.counted += 1
            cache.accumulated += abs(1.0 - cache.magnitude)
            error = cache.accumulated if cache.counted <= method.max_skip else None
        (reusing if reuse(state, error) else computing).append(i)

    out, residuals = _every_block(blocks, batch, computing, reusing)
    for i, residual in zip(computing, residuals, strict=True):
        state = states[i]
        if method.record is not None and state.cache is not None:  # tools/calibrate.py: the ratio of norms
            ratio = residual.float().norm(dim=-1) / (state.cache.rest.float().norm(dim=-1) + 1e-8)
            method.record.append((float(state.step_index), float(ratio.mean())))
        _renew(state, torch.empty(0), residual)
        cache = state.cache
        cache.magnitude, cache.counted, cache.accumulated = 1.0, 0, 0.0
    return out


def _every_block(
    blocks: Sequence[Any], batch: Batch, computing: list[int], reusing: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """TeaCache's and MagCache's forward: every block over the computing requests' rows (a sub-batch); a reusing
    request adds the residual all blocks added at its last computed step (counted as reused). Returns the image
    tokens of every row and the computing requests' new residuals, in `computing` order."""
    h, rows, states = batch.h, batch.rows, batch.states
    ran = run_blocks(blocks, h, batch.enc, batch, computing)
    residuals = []
    for k, i in enumerate(computing):
        assert ran.hc is not None
        residuals.append(ran.hc[k * rows : (k + 1) * rows] - h[i * rows : (i + 1) * rows])
    for i in reusing:
        mine = slice(i * rows, (i + 1) * rows)
        cache = states[i].cache
        ran.h[mine] = h[mine] + fit(cache.rest, h.shape[1])
        cache.reused += 1
    return ran.h, residuals


def x0_computing(method: Method, states: Sequence[Any]) -> list[int]:
    """x0cache's decision, before anything runs: the requests that compute (the others hold their clean image)."""
    computing: list[int] = []
    for i, state in enumerate(states):
        cache = state.cache
        estimate = None if cache is None or cache.rate is None else cache.rate * (cache.since + 1)
        if cache is not None and cache.since >= method.max_run:
            estimate = None  # computes: reused max_run steps in a row
        if reuse(state, estimate):
            cache.holding = True
            cache.since += 1
            cache.reused += 1
        else:
            computing.append(i)
    return computing


def _x0cache(method: Method, blocks: Sequence[Any], batch: Batch) -> torch.Tensor:
    """x0cache's decision and blocks: the reusing requests' rows run none (their output is replaced by `settle`)."""
    return run_blocks(blocks, batch.h, batch.enc, batch, x0_computing(method, batch.states)).h


def settle(method: Method, out: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, rows: int, states: Sequence[Any]):
    """x0cache, after the forward: the model output `out` [B * rows, ...] for the input `x` at noise levels `sigma`
    [B * rows] (flow matching: x0 = x - sigma * out). Other methods: `out` as it is."""
    if method.name != "x0cache":
        return out
    sigma = sigma.to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
    return settle_x0(method, out, x - sigma * out, rows, states, lambda mine, x0: (x[mine] - x0) / sigma[mine])


def settle_x0(method: Method, out: torch.Tensor, x0: torch.Tensor, rows: int, states: Sequence[Any], output_of):
    """x0cache, after the forward, for any parametrisation: `x0` [B * rows, ...] the clean image `out` predicts, and
    `output_of(rows, x0)` the output that predicts a given one for those rows (a slice). A computing request's
    predicted clean image renews its cache (and its rate of change, measured over all its rows on every rank:
    `changes`); a reusing request's rows become the output that predicts its cached one."""
    previous = [None if s.cache is None or s.cache.holding else s.cache.signal for s in states]
    for i, (state, change) in enumerate(zip(states, changes(x0, rows, previous), strict=True)):
        mine = slice(i * rows, (i + 1) * rows)
        cache = state.cache
        if cache is not None and cache.holding:
            out[mine] = output_of(mine, cache.signal).to(out.dtype)
            cache.holding = False
        elif cache is None:
            state.cache = RequestCache(x0[mine].clone(), torch.empty(0), computed=1)
        else:
            assert change is not None
            cache.rate = change / (cache.since + 1)
            cache.signal, cache.since = x0[mine].clone(), 0
            cache.computed += 1
    return out


def _modulated_input(block: Any, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """The first block's adaptive norm: its normalised, shifted and scaled input (SD3, SD3.5 and FLUX blocks alike
    return it first from `norm1`). Families whose blocks modulate otherwise pass their own (`modulated=`)."""
    return block.norm1(h, emb=temb)[0]


def _dbcache(method: Method, blocks: Sequence[Any], batch: Batch) -> torch.Tensor:
    """fbcache and DBCache: the first `fn` blocks over every row decide, the middle ones run for the requests that
    compute, the last `bn` over every row again."""
    h, rows, states = batch.h, batch.rows, batch.states
    middle_end = len(blocks) - method.bn
    every = list(range(len(states)))
    front = run_blocks(blocks[: method.fn], h, batch.enc, batch, every)
    hf, ef = front.hc, front.ec
    assert hf is not None
    first = batch.signal(hf - h)
    computing: list[int] = []  # requests whose rows run the middle blocks
    reusing: list[int] = []
    for i, (state, change) in enumerate(zip(states, changes(first, rows, signals(states)), strict=True)):
        warm = state.step_index < method.warmup
        (reusing if not warm and reuse(state, change) else computing).append(i)

    back = method.bn > 0
    text_rest = back and not batch.context  # the text tokens' residual, kept where the blocks change them
    mid = run_blocks(blocks[method.fn : middle_end], hf, ef, batch, computing, text=text_rest)
    for k, i in enumerate(computing):
        mine, theirs = slice(i * rows, (i + 1) * rows), slice(k * rows, (k + 1) * rows)
        assert mid.hc is not None
        # (the text tokens after the last block: None in SD3, whose last block takes them only)
        assert not text_rest or mid.ec is not None
        rest_text = mid.ec[theirs] - ef[mine] if text_rest else None
        _renew_span(method, states[i], first[mine], mid.hc[theirs] - hf[mine], rest_text)
    out, text = mid.h, mid.text
    for i in reusing:
        mine = slice(i * rows, (i + 1) * rows)
        state = states[i]
        cache = state.cache
        out[mine] = hf[mine] + _forecast(cache.rest, cache.rest_diffs, state.step_index - cache.at, hf.shape[1])
        if text_rest:
            assert text is not None and cache.rest_text is not None
            gap = state.step_index - cache.at
            text[mine] = ef[mine] + _forecast(cache.rest_text, cache.text_diffs, gap, ef.shape[1])
        cache.reused += 1
    if not back:
        return out
    if not text_rest:
        text = ef
    assert text is not None
    return run_blocks(blocks[middle_end:], out, text, batch, every).h


def _renew_span(method: Method, state: Any, signal: torch.Tensor, rest: torch.Tensor, text: torch.Tensor | None):
    """DBCache's computed step: the request's signal and the span's residuals (with TaylorSeer, their differences
    against its last computed ones too)."""
    cache = state.cache
    if method.taylorseer and cache is not None:
        gap = state.step_index - cache.at
        cache.rest_diffs = _differences(rest, cache.rest, cache.rest_diffs, gap, method.taylorseer_order)
        if text is not None and cache.rest_text is not None:
            cache.text_diffs = _differences(text, cache.rest_text, cache.text_diffs, gap, method.taylorseer_order)
    _renew(state, signal, rest)
    state.cache.at = state.step_index
    if text is not None:
        state.cache.rest_text = text.clone()


def _differences(
    new: torch.Tensor, old: torch.Tensor, old_diffs: list[torch.Tensor], gap: int, order: int
) -> list[torch.Tensor]:
    """TaylorSeer's finite differences of a value computed now (`new`) and `gap` steps before (`old`, whose own
    differences were `old_diffs`): the k-th is the change of the (k-1)-th per step, up to `order` (fewer while the
    history is shorter)."""
    diffs: list[torch.Tensor] = []
    tokens = new.shape[1]
    current, previous = new, fit(old, tokens)
    for k in range(order):
        diffs.append((current - previous) / gap)
        if k >= len(old_diffs):
            break
        current, previous = diffs[-1], fit(old_diffs[k], tokens)
    return diffs


def _forecast(value: torch.Tensor, diffs: list[torch.Tensor], gap: int, tokens: int) -> torch.Tensor:
    """TaylorSeer's forecast `gap` steps after `value` was computed: value + sum_k diffs[k-1] * gap^k / k!
    (plain reuse without differences), at `tokens` tokens."""
    out, factor = fit(value, tokens), 1.0
    for k, diff in enumerate(diffs, start=1):
        factor *= gap / k
        out = out + factor * fit(diff, tokens)
    return out


def _teacache(method: Method, blocks: Sequence[Any], batch: Batch, modulate: Any) -> torch.Tensor:
    h, rows, states = batch.h, batch.rows, batch.states
    modulated = batch.signal(modulate(blocks[0], h, batch.temb))
    raw = changes(modulated, rows, signals(states))
    computing: list[int] = []
    reusing: list[int] = []
    estimates: list[float | None] = []
    for i, (state, change) in enumerate(zip(states, raw, strict=True)):
        estimate = None if change is None else state.cache.accumulated + method.rescale(change)
        estimates.append(estimate)
        (reusing if reuse(state, estimate) else computing).append(i)

    out, residuals = _every_block(blocks, batch, computing, reusing)
    for i, residual in zip(computing, residuals, strict=True):
        state = states[i]
        if method.record is not None and state.cache is not None and raw[i] is not None:
            method.record.append((raw[i], relative_l1(residual, state.cache.rest)))
        _renew(state, modulated[i * rows : (i + 1) * rows], residual)
        state.cache.accumulated = 0.0
    for i in reusing:  # TeaCache compares consecutive steps, computed or not
        cache = states[i].cache
        cache.signal = modulated[i * rows : (i + 1) * rows].clone()
        cache.accumulated = estimates[i]
    return out


def _renew(state: Any, signal: torch.Tensor, rest: torch.Tensor) -> None:
    """A computed step: the request's cache takes its new signal and residual (cloned: views would keep the batch
    tensors alive)."""
    if state.cache is None:
        state.cache = RequestCache(signal.clone(), rest.clone(), computed=1)
    else:
        state.cache.signal, state.cache.rest = signal.clone(), rest.clone()
        state.cache.computed += 1
