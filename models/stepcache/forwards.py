"""The transformers' forwards with a step cache decision per request (models/stepcache/methods.py): SD3/SD3.5, FLUX.1,
Ovis-Image, LongCat-Image, Qwen-Image and Wan, as their diffusers `forward`s compute them, with the blocks run by
`methods.cached_blocks` and the output settled by `methods.settle` (x0cache). Each family's step cache
(models/stepcache/cache.py) runs its own, as `forward(method, batched, shared, rows, states)` with the transformer
(and Ulysses group) bound by keyword."""

from __future__ import annotations

import math
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
    ids = torch.cat((shared["txt_ids"], img_ids), dim=0)
    # (Under Ulysses the last block gathers the tokens: the output, as the input here, is every token.)
    return _flux_blocks(method, t, (h, enc, temb), ids, batched, rows, states, joint_attention_kwargs=None)


def _flux_blocks(
    method: Method,
    t: Any,
    embedded: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ids: torch.Tensor,
    batched: dict[str, torch.Tensor],
    rows: int,
    states: Sequence[Any],
    **block_kwargs: Any,
) -> torch.Tensor:
    """The rest of a FLUX-kind forward (FLUX.1, Ovis-Image, LongCat-Image) after its embeddings (`embedded`: image
    tokens, text tokens, timestep embedding): rotary angles of `ids`, the double- then single-stream blocks through
    the cache, the output layers, settled."""
    h, enc, temb = embedded
    rotary = t.pos_embed(ids)
    blocks = [*t.transformer_blocks, *t.single_transformer_blocks]
    batch = Batch(
        h, enc, temb, rows, states, narrows=lora_narrows(t), block_kwargs={"image_rotary_emb": rotary, **block_kwargs}
    )
    out = cached_blocks(method, blocks, batch)
    return settle(
        method, t.proj_out(t.norm_out(out, temb)), batched["hidden_states"], batched["timestep"], rows, states
    )


@torch.inference_mode()
def ovis_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """`OvisImageTransformer2DModel.forward` over B requests x `rows` rows (packed latents), with a cache decision per
    request, as FLUX.1's (`flux_forward`): its blocks are FLUX's in kind; its embeddings differ (the timestep alone,
    the text RMS-normed before its projection). Returns the model output [B * rows, seq, C * 4]."""
    t = transformer
    h = t.x_embedder(batched["hidden_states"])
    timestep = batched["timestep"].to(h.dtype) * 1000
    temb = t.timestep_embedder(t.time_proj(timestep).to(dtype=h.dtype))
    enc = t.context_embedder(t.context_embedder_norm(batched["encoder_hidden_states"]))
    ids = torch.cat((shared["txt_ids"], shared["img_ids"]), dim=0)
    return _flux_blocks(method, t, (h, enc, temb), ids, batched, rows, states, joint_attention_kwargs=None)


@torch.inference_mode()
def longcat_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """`LongCatImageTransformer2DModel.forward` over B requests x `rows` rows, with a cache decision per request, as
    `ovis_forward` (its own timestep embedding; the text projected as it comes). Returns [B * rows, seq, C * 4]."""
    t = transformer
    h = t.x_embedder(batched["hidden_states"])
    temb = t.time_embed(batched["timestep"].to(h.dtype) * 1000, h.dtype)
    enc = t.context_embedder(batched["encoder_hidden_states"])
    ids = torch.cat((shared["txt_ids"], shared["img_ids"]), dim=0)
    return _flux_blocks(method, t, (h, enc, temb), ids, batched, rows, states)  # its blocks take no attention kwargs


class _QwenBlock:
    """A Qwen-Image block as `cached_blocks` calls blocks. Edit-2511 (`zero_cond_t`): the input images' tokens take
    timestep 0's modulation (`index`: which tokens, [1, S]), so each row's `temb` is a pair [rows, 2, D] (the
    noise's, timestep 0's), which a sub-batch narrows with its rows; the block takes them as its forward builds
    them: every row's first, then every row's second."""

    def __init__(self, block: Any, index: torch.Tensor | None) -> None:
        self.block, self.index = block, index

    def temb(self, temb: torch.Tensor) -> torch.Tensor:
        return temb if self.index is None else torch.cat([temb[:, 0], temb[:, 1]])

    def __call__(self, hidden_states, encoder_hidden_states, temb, **kwargs):
        return self.block(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            temb=self.temb(temb),
            modulate_index=self.index,
            **kwargs,
        )


def _qwen_modulated(wrapped: _QwenBlock, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """A Qwen-Image block's modulated image input, as its forward computes it before attention."""
    block = wrapped.block
    img_mod1 = block.img_mod(wrapped.temb(temb)).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(h), img_mod1, wrapped.index)[0]


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
    index = None
    if getattr(t, "zero_cond_t", False):  # Edit-2511: the input images' tokens at timestep 0
        timestep = torch.cat([timestep, timestep * 0])
        index = torch.tensor(
            [[0] * math.prod(s[0]) + [1] * sum(math.prod(x) for x in s[1:]) for s in shared["img_shapes"]],
            device=h.device,
            dtype=torch.int,
        )
    enc = t.txt_in(t.txt_norm(batched["encoder_hidden_states"]))
    text_len, _, mask = compute_text_seq_len_from_mask(enc, batched.get("encoder_hidden_states_mask"))
    guidance = batched.get("guidance")
    layered = batched.get("additional_t_cond")  # Qwen-Image-Layered's RGB/RGBA index per row
    if guidance is None:
        temb = t.time_text_embed(timestep, h, layered)
    else:
        temb = t.time_text_embed(timestep, guidance.to(h.dtype) * 1000, h, layered)
    if index is not None:
        temb = torch.stack(temb.chunk(2), dim=1)  # [rows, 2, D]: the noise's, timestep 0's
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
    blocks = [_QwenBlock(b, index) for b in t.transformer_blocks]
    out = cached_blocks(method, blocks, batch, modulated=_qwen_modulated)
    temb = temb if index is None else temb[:, 0]
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


class _Flux2Block:
    """A FLUX.2 block as `cached_blocks` calls blocks. Each row's `temb` holds its three modulations side by side
    (the double-stream blocks' image and text ones, the single-stream blocks' one: `widths`), so that a sub-batch
    narrows them with its rows. A single-stream block takes the text and image tokens apart and gives them back
    apart (it joins them for its attention, as the transformer's forward does once)."""

    def __init__(self, block: Any, widths: tuple[int, int, int], single: bool) -> None:
        self.block, self.widths, self.single = block, widths, single

    def mods(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return temb.split(self.widths, dim=-1)

    def __call__(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb):
        img, txt, single = self.mods(temb)
        if self.single:
            return self.block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb_mod=single,
                image_rotary_emb=image_rotary_emb,
                split_hidden_states=True,
            )
        return self.block(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            temb_mod_img=img,
            temb_mod_txt=txt,
            image_rotary_emb=image_rotary_emb,
        )


def _flux2_modulated(wrapped: _Flux2Block, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """A FLUX.2 double-stream block's modulated image input, as its forward computes it before attention."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    shift, scale, _ = Flux2Modulation.split(wrapped.mods(temb)[0], 2)[0]
    return (1 + scale) * wrapped.block.norm1(h) + shift


@torch.inference_mode()
def flux2_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """`Flux2Transformer2DModel.forward` (FLUX.2 klein and dev) over B requests x `rows` rows (packed latents, an
    edit's reference tokens after them), with a cache decision per request: the first double-stream block decides;
    the double- and single-stream blocks after it are skipped together. Returns [B * rows, seq, C * 4]."""
    t = transformer
    x = batched["hidden_states"]
    h = t.x_embedder(x)
    timestep = batched["timestep"].to(h.dtype) * 1000
    guidance = batched.get("guidance")
    if guidance is not None:
        guidance = guidance.to(h.dtype) * 1000
    temb = t.time_guidance_embed(timestep, guidance)
    mods = [
        t.double_stream_modulation_img(temb),
        t.double_stream_modulation_txt(temb),
        t.single_stream_modulation(temb),
    ]
    widths = tuple(m.shape[-1] for m in mods)
    enc = t.context_embedder(batched["encoder_hidden_states"])
    img_ids, txt_ids = shared["img_ids"], shared["txt_ids"]
    img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
    image, text = t.pos_embed(img_ids), t.pos_embed(txt_ids)
    rotary = (torch.cat([text[0], image[0]]), torch.cat([text[1], image[1]]))
    blocks = [_Flux2Block(b, widths, single=False) for b in t.transformer_blocks]
    blocks += [_Flux2Block(b, widths, single=True) for b in t.single_transformer_blocks]
    batch = Batch(
        h,
        enc,
        torch.cat(mods, dim=-1),
        rows,
        states,
        narrows=lora_narrows(t),
        block_kwargs={"image_rotary_emb": rotary},
    )
    out = cached_blocks(method, blocks, batch, modulated=_flux2_modulated)
    return settle(method, t.proj_out(t.norm_out(out, temb)), x, batched["timestep"], rows, states)


class _ZImageSpan(torch.nn.Module):
    """Stands in for Z-Image's main layers (`transformer.layers`) during one cached forward: the transformer's own
    forward builds the joint sequence (image tokens, then the caption's, each row padded to the batch's longest) and
    calls this once where it would call its layers one by one; this runs them through `cached_blocks`."""

    def __init__(self, method: Method, layers: Any, rows: int, states: Sequence[Any], narrows: Sequence[Any]) -> None:
        super().__init__()
        self.method, self.rows, self.states, self.narrows = method, rows, states, narrows
        self.wrapped = [_ZImageBlock(layer) for layer in layers]

    def forward(self, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None, *rest):
        if noise_mask is not None:
            raise NotImplementedError("Z-Image's omni mode (per-token modulation) has no cached forward")
        batch = Batch(
            x,
            x.new_zeros(x.shape[0], 0, x.shape[2]),  # no second stream: the caption is in the joint sequence
            adaln_input,
            self.rows,
            self.states,
            row_kwargs={"attn_mask": attn_mask, "freqs_cis": freqs_cis},
            narrows=self.narrows,
            context=True,
            valid=attn_mask,
        )
        return cached_blocks(self.method, self.wrapped, batch, modulated=_zimage_modulated)


class _ZImageBlock:
    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def __call__(self, hidden_states, encoder_hidden_states, temb, attn_mask, freqs_cis):
        return encoder_hidden_states, self.layer(hidden_states, attn_mask, freqs_cis, temb)


def _zimage_modulated(wrapped: _ZImageBlock, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """A Z-Image layer's modulated input to its attention, as its forward computes it."""
    layer = wrapped.layer
    scale = 1.0 + layer.adaLN_modulation(temb).unsqueeze(1).chunk(4, dim=2)[0]
    return layer.attention_norm1(h) * scale


@torch.inference_mode()
def zimage_forward(
    method: Method,
    batched: dict[str, Any],
    shared: dict[str, Any],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
    call: Any,
) -> torch.Tensor:
    """`ZImageTransformer2DModel.forward` (its own, through the family's `call`) over B requests x `rows` rows, with
    its main layers run by `_ZImageSpan`: a cache decision per request, read over each row's own tokens. Returns
    [B * rows, C, 1, h, w]. Its output is the negative velocity at `1 - sigma` (as the pipeline reads it)."""
    t = transformer
    layers = t.layers
    t._modules["layers"] = torch.nn.ModuleList([_ZImageSpan(method, layers, rows, states, lora_narrows(t))])
    try:
        out = call(batched, shared)
    finally:
        t._modules["layers"] = layers
    sigma = 1 - batched["timestep"]  # the family's timestep is 1 - sigma, and its output -v: x0 = x + sigma * out
    return settle(method, out, batched["hidden_states"], -sigma, rows, states)
