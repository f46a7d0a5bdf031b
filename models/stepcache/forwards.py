"""The transformers' forwards with a step cache decision per request (models/stepcache/methods.py): SD3/SD3.5, FLUX.1,
Qwen-Image and Wan, as their diffusers `forward`s compute them, with the blocks run by `methods.cached_blocks` and the
output settled by `methods.settle` (x0cache). Each family's step cache (models/stepcache/cache.py) runs its own, as
`forward(method, batched, shared, rows, states)` with the transformer (and Ulysses group) bound by keyword."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusiond.kernels.lora_rows import LoraLayers
from diffusiond.models.families.wan.attention import local_tokens
from diffusiond.models.stepcache.methods import Batch, Method, cached_blocks, settle


def lora_narrows(transformer: Any) -> tuple[LoraLayers, ...]:
    """The transformer's LoRA layers, whose row plan a sub-batch narrows (none without LoRA)."""
    layers = LoraLayers.of(transformer)
    return () if layers is None else (layers,)


@torch.inference_mode()
def sd3_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, Any],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """`SD3Transformer2DModel.forward` over B requests x `rows` rows, with a cache decision per request.
    Returns the model output [B * rows, C, H, W]."""
    t = transformer
    x = batched["hidden_states"]
    height, width = x.shape[-2:]
    h = t.pos_embed(x).contiguous()
    temb = t.time_text_embed(batched["timestep"], batched["pooled_projections"])
    enc = t.context_embedder(batched["encoder_hidden_states"])
    batch = Batch(h, enc, temb, rows, states, narrows=lora_narrows(t), block_kwargs={"joint_attention_kwargs": None})
    out = cached_blocks(method, t.transformer_blocks, batch)
    hidden = t.proj_out(t.norm_out(out, temb))
    p = t.config.patch_size
    hidden = hidden.reshape(hidden.shape[0], height // p, width // p, p, p, t.out_channels)
    hidden = torch.einsum("nhwpqc->nchpwq", hidden)
    hidden = hidden.reshape(hidden.shape[0], t.out_channels, height, width)
    return settle(method, hidden, x, batched["timestep"] / 1000, rows, states)  # SD3's timestep: sigma x 1000


@torch.inference_mode()
def flux_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
    ulysses: Any = None,
) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` over B requests x `rows` rows (packed latents), with a cache decision per
    request: the first double-stream block decides (fbcache: its residual; teacache: its modulated input); the
    double- and single-stream blocks after it (teacache: all of them) are skipped together. Returns the model output
    [B * rows, seq, C * 4]."""
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
    block_kwargs = {"image_rotary_emb": rotary, "joint_attention_kwargs": None}
    out = cached_blocks(
        method, blocks, Batch(h, enc, temb, rows, states, narrows=lora_narrows(t), block_kwargs=block_kwargs)
    )
    # (Under Ulysses the last block gathers the tokens: the output, as the input here, is every token.)
    return settle(
        method, t.proj_out(t.norm_out(out, temb)), batched["hidden_states"], batched["timestep"], rows, states
    )


def _qwen_modulated(block: Any, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """A Qwen-Image block's modulated image input, as its forward computes it before attention."""
    img_mod1 = block.img_mod(temb).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(h), img_mod1)[0]


@torch.inference_mode()
def qwen_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, Any],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """`QwenImageTransformer2DModel.forward` over B requests x `rows` rows (packed latents), with a cache decision
    per request; a padded batch's text mask is sub-batched with the rows. Returns [B * rows, seq, C * 4]."""
    from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

    t = transformer
    h = t.img_in(batched["hidden_states"])
    timestep = batched["timestep"].to(h.dtype)
    enc = t.txt_in(t.txt_norm(batched["encoder_hidden_states"]))
    text_len, _, mask = compute_text_seq_len_from_mask(enc, batched.get("encoder_hidden_states_mask"))
    guidance = batched.get("guidance")
    if guidance is None:
        temb = t.time_text_embed(timestep, h, None)
    else:
        temb = t.time_text_embed(timestep, guidance.to(h.dtype) * 1000, h, None)
    rotary = t.pos_embed(shared["img_shapes"], max_txt_seq_len=text_len, device=h.device)
    batch = Batch(
        h,
        enc,
        temb,
        rows,
        states,
        row_kwargs={"encoder_hidden_states_mask": mask},  # a padded batch's: a row per batch row
        narrows=lora_narrows(t),
        block_kwargs={"image_rotary_emb": rotary, "joint_attention_kwargs": None},
    )
    out = cached_blocks(method, t.transformer_blocks, batch, modulated=_qwen_modulated)
    return settle(
        method, t.proj_out(t.norm_out(out, temb)), batched["hidden_states"], batched["timestep"], rows, states
    )


class _WanBlock:
    """A Wan block as `cached_blocks` calls blocks: the text context goes in and comes back unchanged (its
    cross-attention reads it; `Batch.context`)."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __call__(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        return encoder_hidden_states, self.block(hidden_states, encoder_hidden_states, temb, rotary_emb)


def _wan_modulated(wrapped: _WanBlock, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """A Wan block's modulated input to its self-attention, as its forward computes it (TI2V: a modulation per
    token)."""
    block = wrapped.block
    if temb.ndim == 4:
        shift, scale = (t.squeeze(2) for t in (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)[:2])
    else:
        shift, scale = (block.scale_shift_table + temb.float()).chunk(6, dim=1)[:2]
    return (block.norm1(h.float()) * (1 + scale) + shift).type_as(h)


@torch.inference_mode()
def wan_forward(
    method: Method,
    transformer: Any,
    batched: dict[str, torch.Tensor],
    sigma: torch.Tensor,
    rows: int,
    states: Sequence[Any],
    narrows: Sequence[Any] = (),
    ulysses: Any = None,
) -> torch.Tensor:
    """`WanTransformer3DModel.forward` over B requests x `rows` rows, with a cache decision per request; `sigma`
    [B * rows]: each row's noise level (x0cache); `narrows`: the LoRA layers and projection plan a sub-batch
    narrows. Under Ulysses the tokens are sharded here, before the blocks, and gathered after the last (the
    blocks' own hooks stand aside): a request's residuals are its shard's. Returns [B * rows, C, T, H, W]."""
    t = transformer
    x = batched["hidden_states"]
    _, _, frames, height, width = x.shape
    p_t, p_h, p_w = t.config.patch_size
    rotary = t.rope(x)
    h = t.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
    timestep = batched["timestep"]
    per_token = timestep.shape[1] if timestep.ndim == 2 else None  # TI2V: a timestep per token
    temb, proj, enc, enc_image = t.condition_embedder(
        timestep.flatten(), batched["encoder_hidden_states"], batched.get("encoder_hidden_states_image"),
        timestep_seq_len=per_token,
    )  # fmt: skip
    proj = proj.unflatten(2, (6, -1)) if per_token is not None else proj.unflatten(1, (6, -1))
    if enc_image is not None:
        enc = torch.concat([enc_image, enc], dim=1)
    if ulysses is not None:  # as the Ulysses pre-hook on the first block, which stands aside
        local = slice(*ulysses.split(h.shape[1]))
        h = h[:, local]
        rotary, proj = local_tokens(local, rotary, proj)
    batch = Batch(h, enc, proj, rows, states, narrows=narrows, block_kwargs={"rotary_emb": rotary}, context=True)
    out = cached_blocks(method, [_WanBlock(b) for b in t.blocks], batch, modulated=_wan_modulated)
    if ulysses is not None:
        out = ulysses.gather_seq(out, dim=1)
    if temb.ndim == 3:
        shift, scale = (c.squeeze(2) for c in (t.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2))
    else:
        shift, scale = (t.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    out = t.proj_out((t.norm_out(out.float()) * (1 + scale) + shift).type_as(out))
    out = out.reshape(out.shape[0], frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    out = out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
    return settle(method, out, x[:, : out.shape[1]], sigma, rows, states)  # image-to-video: the noisy channels
