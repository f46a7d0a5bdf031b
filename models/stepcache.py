"""Step caching with a decision per request, inside a batched forward (first-block cache).

Cache methods elsewhere (diffusers' `first_block_cache` hook, Cache-DiT, TeaCache) decide once for the whole batch
tensor: in a batch that mixes requests at different steps, with different thresholds or none, that decision is
wrong for most of them. Here every request decides alone:

1. the first transformer block runs for every row of the batch;
2. each request compares its first block's residual (output - input) with the one it had at its last fully computed
   step: relative L1 change `mean|r - r_prev| / mean|r_prev|` over its rows (both CFG rows: the decision is per
   request, the residuals are per row);
3. below the request's threshold, the request reuses the residual its remaining blocks added at that step; at or
   above it (and always at its first and last step, and with threshold 0), its rows go through the remaining blocks
   in a sub-batch of the requests that compute, and its cache is renewed.

State lives on the request's `RequestState.cache` and goes with it. Exactness: with threshold 0 every row computes,
through the same blocks in the same order as the pipeline's forward (tests compare with diffusers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

METHODS = ("none", "fbcache")


@dataclass
class FirstBlockCache:
    """One request's cache: its rows' first-block residual and remaining-blocks residual at its last computed step."""

    first: torch.Tensor
    rest: torch.Tensor
    computed: int = 0
    reused: int = 0


def reuse(state: Any, change: float | None) -> bool:
    """Whether this request may skip its remaining blocks at this step. `change`: the relative L1 change of its
    first-block residual since its last computed step, over all its rows and tokens on every rank (None: no cache)."""
    threshold = state.params.cache_threshold or 0.0
    last = state.step_index + 1 >= state.total_steps
    if threshold <= 0 or change is None or state.step_index == 0 or last:
        return False
    return change < threshold


def changes(first: torch.Tensor, rows: int, states: Sequence[Any]) -> list[float | None]:
    """Each request's relative change, agreed by every rank of a group: the sums |r - r_prev| and |r_prev| over the
    rows and tokens each rank holds are all-reduced, so a request split across ranks (CFG-parallel: a row each;
    Ulysses: a token shard each) decides once, the same everywhere. (Ranks that hold the same rows add copies of
    the same sums; the ratio is unchanged.)"""
    import torch.distributed as dist

    sums = torch.zeros(len(states), 2, dtype=torch.float64, device=first.device)
    for i, state in enumerate(states):
        if state.cache is not None:
            mine = first[i * rows : (i + 1) * rows].double()
            sums[i, 0] = (mine - state.cache.first.double()).abs().sum()
            sums[i, 1] = state.cache.first.double().abs().sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)  # every rank runs every step's forward (SPMD): the world is the right group
    values = (sums[:, 0] / sums[:, 1].clamp_min(1e-12)).tolist()
    return [None if state.cache is None else value for state, value in zip(states, values, strict=True)]


def cached_blocks(
    first_block: Any,
    rest: Sequence[Any],
    h: torch.Tensor,
    enc: torch.Tensor,
    temb: torch.Tensor,
    rows: int,
    states: Sequence[Any],
    **block_kwargs: Any,
) -> torch.Tensor:
    """The transformer's blocks over B requests x `rows` rows with a decision per request: image tokens after the last
    block [B * rows, S, D]. Every block takes (hidden_states, encoder_hidden_states, temb, **block_kwargs) and returns
    (encoder_hidden_states, hidden_states), as diffusers' SD3 and FLUX blocks do."""
    enc1, h1 = first_block(hidden_states=h, encoder_hidden_states=enc, temb=temb, **block_kwargs)
    first = h1 - h

    computing: list[int] = []  # requests whose rows run the remaining blocks
    reusing: list[int] = []
    for state, change, i in zip(states, changes(first, rows, states), range(len(states)), strict=True):
        (reusing if reuse(state, change) else computing).append(i)

    out = h1.clone() if reusing else h1
    if computing:
        if reusing:
            index = torch.tensor([i * rows + r for i in computing for r in range(rows)], device=h1.device)
            hc, ec, tc = h1[index], enc1[index], temb[index]
        else:  # everyone computes: the full batch, exactly as the pipeline's forward
            hc, ec, tc = h1, enc1, temb
        for block in rest:
            ec, hc = block(hidden_states=hc, encoder_hidden_states=ec, temb=tc, **block_kwargs)
        if reusing:
            out[index] = hc
        else:
            out = hc
        for k, i in enumerate(computing):
            mine = slice(i * rows, (i + 1) * rows)
            rest_residual = hc[k * rows : (k + 1) * rows] - h1[mine]
            cache = states[i].cache
            if cache is None:
                states[i].cache = FirstBlockCache(first[mine].clone(), rest_residual.clone(), computed=1)
            else:
                cache.first, cache.rest = first[mine].clone(), rest_residual.clone()
                cache.computed += 1
    for i in reusing:
        mine = slice(i * rows, (i + 1) * rows)
        out[mine] = h1[mine] + states[i].cache.rest
        states[i].cache.reused += 1
    return out


@torch.inference_mode()
def sd3_forward(transformer: Any, batched: dict[str, torch.Tensor], rows: int, states: Sequence[Any]) -> torch.Tensor:
    """`SD3Transformer2DModel.forward` over B requests x `rows` rows, with a first-block cache decision per request.
    Returns the model output [B * rows, C, H, W]."""
    t = transformer
    x = batched["hidden_states"]
    height, width = x.shape[-2:]
    h = t.pos_embed(x).contiguous()
    temb = t.time_text_embed(batched["timestep"], batched["pooled_projections"])
    enc = t.context_embedder(batched["encoder_hidden_states"])
    blocks = t.transformer_blocks
    out = cached_blocks(blocks[0], blocks[1:], h, enc, temb, rows, states, joint_attention_kwargs=None)
    hidden = t.proj_out(t.norm_out(out, temb))
    p = t.config.patch_size
    hidden = hidden.reshape(hidden.shape[0], height // p, width // p, p, p, t.out_channels)
    hidden = torch.einsum("nhwpqc->nchpwq", hidden)
    return hidden.reshape(hidden.shape[0], t.out_channels, height, width)


@torch.inference_mode()
def flux_forward(
    transformer: Any,
    batched: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    rows: int,
    states: Sequence[Any],
    ulysses: Any = None,
) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` over B requests x `rows` rows (packed latents), with a first-block cache
    decision per request: the first double-stream block decides; the rest and every single-stream block are skipped
    together. Returns the model output [B * rows, seq, C * 4]."""
    t = transformer
    hidden, img_ids = batched["hidden_states"], shared["img_ids"]
    if ulysses is not None:  # as the Ulysses pre-hook on the transformer's forward, which this bypasses
        start, stop = ulysses.split(hidden.shape[1])
        ulysses.text_len = batched["encoder_hidden_states"].shape[1]
        hidden, img_ids = hidden[:, start:stop], img_ids[start:stop]
    h = t.x_embedder(hidden)
    timestep = batched["timestep"].to(h.dtype) * 1000
    guidance = batched.get("guidance")
    if guidance is None:
        temb = t.time_text_embed(timestep, batched["pooled_projections"])
    else:
        temb = t.time_text_embed(timestep, guidance.to(h.dtype) * 1000, batched["pooled_projections"])
    enc = t.context_embedder(batched["encoder_hidden_states"])
    rotary = t.pos_embed(torch.cat((shared["txt_ids"], img_ids), dim=0))
    blocks = [*t.transformer_blocks, *t.single_transformer_blocks]
    out = cached_blocks(
        blocks[0], blocks[1:], h, enc, temb, rows, states, image_rotary_emb=rotary, joint_attention_kwargs=None
    )
    return t.proj_out(t.norm_out(out, temb))
