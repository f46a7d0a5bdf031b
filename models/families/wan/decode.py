"""A Wan clip decoded in pieces, between steps: `AutoencoderKLWan`'s decode split into stages of a latent frame, so
that the executor can run a few pieces a step (models/base.py `decode_in_pieces`) and a long clip's decode does not
hold up a step of a higher class."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch


def wan_pieces(vae: Any, latents: torch.Tensor) -> Generator[None, None, torch.Tensor]:
    """`AutoencoderKLWan` decoding [B, C, T, h, w] (the VAE's space) in pieces, yielding between them; returns the
    video [B, 3, F, H, W] in [-1, 1], equal to `vae.decode`'s: the same calls in the same order (its `_decode`, a
    latent frame at a time, the decoder's causal convolutions carrying the frames before in a cache, here this
    decode's own so that decodes may interleave; `WanDecoder3d.forward`, in stages: input convolution and middle,
    each resnet and upsampler of each up block, the head). A piece is a stage of a latent frame: the longest, a
    resnet of the last up block at full size."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify

    decoder = vae.decoder
    cache: list[Any] = [None] * sum(isinstance(m, WanCausalConv3d) for m in decoder.modules())
    with torch.inference_mode():
        x = vae.post_quant_conv(latents)
    frames = []
    for i in range(x.shape[2]):
        index, first = [0], i == 0
        with torch.inference_mode():
            h = _cached_conv(decoder.conv_in, x[:, :, i : i + 1], cache, index)
            h = decoder.mid_block(h, feat_cache=cache, feat_idx=index)
        for up_block in decoder.up_blocks:
            yield
            h = yield from _up_block_pieces(up_block, h, cache, index, first)
        yield
        with torch.inference_mode():
            frames.append(_cached_conv(decoder.conv_out, decoder.nonlinearity(decoder.norm_out(h)), cache, index))
        if i + 1 < x.shape[2]:
            yield
    with torch.inference_mode():
        out = torch.cat(frames, 2)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        return torch.clamp(out, min=-1.0, max=1.0)


def _up_block_pieces(block: Any, h: torch.Tensor, cache: list[Any], index: list[int], first: bool):
    """A decoder up block a resnet at a time, yielding between them: the calls of `WanUpBlock.forward` (Wan 2.1) or
    `WanResidualUpBlock.forward` (Wan 2.2 TI2V's, with its shortcut), in order. A block of another kind runs whole.
    Measured on the tiny Wan (96x96): the last up block at full size took 26-29 ms as one piece; a resnet at most 10."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualUpBlock, WanUpBlock

    if type(block) not in (WanUpBlock, WanResidualUpBlock):
        with torch.inference_mode():
            return block(h, feat_cache=cache, feat_idx=index, first_chunk=first)
    residual = isinstance(block, WanResidualUpBlock)
    with torch.inference_mode():
        shortcut = h.clone() if residual else None
    upsampler = block.upsampler if residual else (block.upsamplers[0] if block.upsamplers is not None else None)
    for j, layer in enumerate([*block.resnets, *([upsampler] if upsampler is not None else [])]):
        if j:
            yield
        with torch.inference_mode():
            h = layer(h, feat_cache=cache, feat_idx=index)
    if residual and block.avg_shortcut is not None:
        with torch.inference_mode():
            h = h + block.avg_shortcut(shortcut, first_chunk=first)
    return h


def _cached_conv(conv: Any, x: torch.Tensor, cache: list[Any], index: list[int]) -> torch.Tensor:
    """A causal convolution of the decoder's input or head over a latent frame, with the frames before from the
    cache (`WanDecoder3d.forward`'s arithmetic: the last two frames kept, one from the chunk before if need be)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T

    idx = index[0]
    keep = x[:, :, -CACHE_T:, :, :].clone()
    if keep.shape[2] < 2 and cache[idx] is not None:
        keep = torch.cat([cache[idx][:, :, -1, :, :].unsqueeze(2).to(keep.device), keep], dim=2)
    out = conv(x, cache[idx])
    cache[idx] = keep
    index[0] += 1
    return out
