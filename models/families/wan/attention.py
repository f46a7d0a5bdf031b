"""Wan's attention pieces (models/families/wan/adapter.py): the cross-attention processor that reads a request's
key/value projections made at admission (models/families/wan/projections.py), the plan that hands them to it per
forward, and the self-attention processor of Ulysses."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from diffusiond.kernels.lora_rows import LoraLayers
from diffusiond.kernels.ulysses import UlyssesGroup, ulysses_sdpa

# The pipelines' `max_sequence_length`: every prompt is padded to it (the image-to-video transformer splits its
# context at 512 text tokens).
TEXT_TOKENS = 512


class WanCrossAttnProcessor:
    """`WanAttnProcessor` for a block's cross-attention, with the batch's key/value rows taken from the projection
    plan where it has them (the same operations in the same order as the stock processor, so a reused row is
    bit-identical to one projected now)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, block: int, plan: ProjectionPlan) -> None:
        self.block = block
        self.plan = plan

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        image_ctx = None
        if attn.add_k_proj is not None:
            split = encoder_hidden_states.shape[1] - TEXT_TOKENS
            image_ctx, encoder_hidden_states = encoder_hidden_states[:, :split], encoder_hidden_states[:, split:]
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, S, H, Dh]
        key, value = self.plan.text_kv(self.block, attn, encoder_hidden_states)  # [B, L, H, Dh] each
        extra = None
        if image_ctx is not None:
            key_img, value_img = self.plan.image_kv(self.block, attn, image_ctx)
            extra = dispatch_attention_fn(
                query, key_img, value_img, attn_mask=None, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=None,
            )  # fmt: skip
            extra = extra.flatten(2, 3).type_as(query)
        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=None,
        )  # fmt: skip
        out = out.flatten(2, 3).type_as(query)
        if extra is not None:
            out = out + extra
        return attn.to_out[1](attn.to_out[0](out))


def apply_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """`WanAttnProcessor`'s rotary embedding of x [B, S, H, Dh] (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesWanSelfAttnProcessor:
    """A block's self-attention (`WanAttnProcessor` without image context) over tokens sharded across `g`: q/k norms
    and rotary angles are per token, so each rank applies them to its shard; the attention itself all-to-alls to the
    whole sequence for H/N heads and back."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, S_local, H, Dh]
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        out = ulysses_sdpa(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), self.g,
            replicated=0, replicated_first=True, backend=self._attention_backend,
        ).transpose(1, 2)  # fmt: skip
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def local_tokens(local: slice, rotary: tuple[torch.Tensor, torch.Tensor], proj: torch.Tensor) -> tuple[Any, Any]:
    """Under Ulysses, this rank's share (`local`, of the token axis) of what goes with the tokens: the rotary angles
    (cos, sin), and TI2V's modulation per token [B, S, 6, D] (a per-request one [B, 6, D] stays whole)."""
    cos, sin = rotary
    if proj.dim() == 4:
        proj = proj[:, local]
    return (cos[:, local], sin[:, local]), proj


def project_text(attn, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cross-attention's key and value of text context rows [B, L, D] -> [B, L, H, Dh] each."""
    key = attn.norm_k(attn.to_k(ctx)).unflatten(2, (attn.heads, -1))
    return key, attn.to_v(ctx).unflatten(2, (attn.heads, -1))


def project_image(attn, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key = attn.norm_added_k(attn.add_k_proj(ctx)).unflatten(2, (attn.heads, -1))
    return key, attn.add_v_proj(ctx).unflatten(2, (attn.heads, -1))


class ProjectionPlan:
    """For the forward running now: per row, its reused text and image projections (`projections.Entry`, tensors
    (key, value) per block in block order), or None where the row is projected in the forward."""

    def __init__(self) -> None:
        self.text: list[Any] = []
        self.image: list[Any] = []
        # The transformer's LoRA layers (LoRA requests project their rows in the forward): a projection of some
        # rows narrows their row plan.
        self.lora: LoraLayers | None = None

    @contextmanager
    def narrow(self, index: Sequence[int] | None) -> Iterator[None]:
        """Calls inside run over rows `index` of the forward's (None: all of them): a step cache's sub-batch."""
        previous = self.text, self.image
        if index is not None:
            self.text = [self.text[i] for i in index] if self.text else []
            self.image = [self.image[i] for i in index] if self.image else []
        try:
            yield
        finally:
            self.text, self.image = previous

    def text_kv(self, block: int, attn, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(self.text, block, ctx, lambda c: project_text(attn, c))

    def image_kv(self, block: int, attn, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(self.image, block, ctx, lambda c: project_image(attn, c))

    def _rows(self, entries: list[Any], block: int, ctx: torch.Tensor, project) -> tuple[torch.Tensor, torch.Tensor]:
        if len(entries) != ctx.shape[0] or all(e is None for e in entries):
            return project(ctx)
        missing = [r for r, e in enumerate(entries) if e is None]
        fresh = {}
        if missing:
            with self.lora.narrow(missing) if self.lora is not None else nullcontext():
                fresh = dict(zip(missing, zip(*project(ctx[missing]), strict=True), strict=True))
        keys, values = [], []
        for r, entry in enumerate(entries):
            if entry is None:
                key, value = fresh[r]
                keys.append(key[None])
                values.append(value[None])
            else:
                keys.append(entry.tensors[2 * block])
                values.append(entry.tensors[2 * block + 1])
        return torch.cat(keys), torch.cat(values)
