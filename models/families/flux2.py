"""FLUX.2 [klein] (`Flux2KleinPipeline` checkpoints): a Qwen3 text encoder read at three of its layers, packed 2x2
latent patches normalised by the VAE's batch-norm statistics, 4-axis rotary ids (time, height, width, layer), a step
schedule whose shift depends on the step count, and classifier-free guidance unless the checkpoint is distilled.

FLUX.2 [dev] (`Flux2Pipeline` checkpoints): the same transformer layout with a guidance embedding (guidance-distilled:
`guidance_scale` is embedded, one row per request, no negative branch), prompts read by a Mistral-3 text encoder
after the pipeline's system message (its Pixtral processor needs torchvision); edits and reference images as klein.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline, compute_empirical_mu

from diffusiond.kernels.ulysses import UlyssesGroup, ulysses_sdpa
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.families.flux import shard_image_tokens
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import packed_latent_size, request_generator
from diffusiond.models.inputs import image_size, open_rgb
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache


class Flux2KleinAdapter(FlowMatchAdapter):
    spec = specs.FLUX2_KLEIN
    vae_family = "flux2"
    default_steps = 50
    default_guidance = 4.0
    TEXT_ENCODERS = ("text_encoder",)

    def _step_cache(self) -> StepCache:
        # Its cached forward does not shard tokens: --cache with --ulysses is refused at start.
        cached = partial(forwards.flux2_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        # Distilled checkpoints never run a negative branch.
        return Flux2Requests(caps, declared, distilled=bool(self.pipe.config.is_distilled), **parts)

    def _context(self, p: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The edit's images as packed tokens [1, ctx, C * 4] and their ids [ctx, 4] (time axis 10, 20, ... one per
        image), by the pipeline's own `prepare_image_latents` (the latent mode: no draw from the generator)."""
        self._stage("vae")
        images = []
        area, sizes = self.requests.max_context_area, self.requests.context_size(p)
        for data, (width, height) in zip((p.image, *(p.reference_images or ())), sizes, strict=True):
            image = open_rgb(data)
            if image.width * image.height > area:
                image = self.pipe.image_processor._resize_to_target_area(image, area)
            images.append(self.pipe.image_processor.preprocess(image, height=height, width=width, resize_mode="crop"))
        tokens, ids = self.pipe.prepare_image_latents(images, 1, generator, self.device, self.vae.dtype)
        return tokens, ids[0].to(self.device)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder (chat template, padded to its 512 tokens, three hidden layers stacked)."""
        self._stage(*self.TEXT_ENCODERS)
        embeds, _ = self.pipe.encode_prompt(prompt=list(texts), device=self.device)
        return [(embeds[i : i + 1].clone(),) for i in range(len(texts))]

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> ([1, L, D],)
        channels = self.transformer.config.in_channels // 4
        states = []
        for i, (request_id, p) in enumerate(requests):
            (embeds,) = text[p.prompt]
            generator = request_generator(p)
            latents, latent_ids = self.pipe.prepare_latents(
                1, channels, p.height, p.width, embeds.dtype, self.device, generator
            )  # [1, seq, C * 4], [1, seq, 4]
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            if getattr(self.pipe.scheduler.config, "use_flow_sigmas", False):
                sigmas = None
            mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=p.num_inference_steps)
            sampler = self._sampler(p, generator, sigmas=sigmas, mu=mu)
            cond = {"embeds": embeds}
            img_ids = latent_ids[0]
            context = None
            if p.image is not None:  # after the noise, as the pipeline draws them
                context, context_ids = self._context(p, generator)
                img_ids = torch.cat([img_ids, context_ids])
            if self.transformer.config.guidance_embeds:  # FLUX.2 [dev]: the scale is embedded
                cond["guidance"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            if cfg[i]:
                # Rows (positive, negative) per request; the pipeline's negative is "" (a request may send its own).
                (negative,) = text[p.negative_prompt or ""]
                cond = {
                    "embeds": torch.cat([embeds, negative]),
                    "scale": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32),
                }
            # Text ids depend on the text length only, which the pipeline pads to the same 512 for every prompt.
            text_ids = Flux2KleinPipeline._prepare_text_ids(embeds)[0].to(self.device)
            shared = {"txt_ids": text_ids, "img_ids": img_ids}
            if context is not None:
                cond["context"] = context.to(embeds.dtype)
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, shared=shared))
        return states

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage(self.denoiser)
        cond = self._batched_cond(states)
        shared = states[0].shared  # same size and text length across the batch (batch key)
        latents = torch.cat([s.latents for s in states])  # [B, seq, C * 4]
        seq = latents.shape[1]
        if "context" in cond:  # an edit's reference tokens follow the latents (as the pipeline's input)
            latents = torch.cat([latents, cond["context"]], dim=1)
        latents = latents.to(self.transformer.dtype)
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device, latents.dtype)  # [B]
        rows = cond["embeds"].shape[0] // len(states)
        batched = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),
            "timestep": timestep.repeat_interleave(rows) / 1000,
            "encoder_hidden_states": cond["embeds"],
        }
        if "guidance" in cond:
            batched["guidance"] = cond["guidance"].repeat_interleave(rows)
        out = self.ranks.rows(rows, batched, shared, states)[:, :, :seq]
        if rows == 1:
            return out[:, 0]
        pos, neg = out[:, 0], out[:, 1]
        return neg + cond["scale"].to(out.dtype).view(-1, 1, 1) * (pos - neg)

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Packed tokens [B, seq, C * 4] -> the VAE's own latents [B, C, h, w], as the pipeline: scattered by their
        ids, the batch-norm statistics undone, the 2x2 patches unfolded."""
        h, w = packed_latent_size(params, self.vae_scale_factor)
        ids = self.pipe._prepare_latent_ids(latents.new_empty(latents.shape[0], 1, h // 2, w // 2)).to(latents.device)
        patches = Flux2KleinPipeline._unpack_latents_with_ids(latents, ids, h // 2, w // 2)
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(
            patches.device, patches.dtype
        )
        return Flux2KleinPipeline._unpatchify_latents(patches * std + mean)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        """Image tokens (with an edit's reference tokens) and their rotary ids sharded across `group`; the text stays
        whole on every rank, the replicated prefix of each joint attention (as FLUX.1's)."""
        self.ranks.ulysses = group
        for block in self.transformer.transformer_blocks:
            block.attn.set_processor(UlyssesFlux2AttnProcessor(group))
        for block in self.transformer.single_transformer_blocks:
            block.attn.set_processor(UlyssesFlux2SingleAttnProcessor(group))
        shard_image_tokens(self.transformer, group)


class Flux2Adapter(Flux2KleinAdapter):
    """FLUX.2 [dev]: guidance-distilled (`guidance_scale` feeds the guidance embedding; never a negative branch)."""

    spec = specs.FLUX2

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return Flux2Requests(caps, declared, distilled=True, **parts)


class Flux2Requests(RequestRules):
    """`distilled`: a checkpoint that never runs a negative branch (a distilled klein, FLUX.2 [dev])."""

    # Reference images above this area are scaled down to it (the pipeline's).
    max_context_area: ClassVar[int] = 1024 * 1024

    def __init__(self, caps: Any, declared: Any, *, distilled: bool, **parts: Any) -> None:
        super().__init__(caps, declared, **parts)
        self.distilled = distilled

    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance`.
        return (params.guidance_scale or 0.0) > 1 and not self.distilled

    def context_size(self, params: SamplingParams) -> tuple[tuple[int, int], ...] | None:
        """(width, height) of each image an edit is conditioned on (`image`, then `reference_images`): at its own
        size, scaled down to 1024x1024's area when larger, sides floored to the packing multiple, as the pipeline
        conditions them."""
        if params.image is None:
            return None
        files = [("image", params.image)] + [("reference_images", data) for data in params.reference_images or ()]
        return tuple(self._conditioned_size(data, param) for param, data in files)

    def _conditioned_size(self, data: bytes, param: str) -> tuple[int, int]:
        width, height = image_size(data, param)
        # The pipeline's `check_image_input`: sides of 64 or more, an aspect ratio up to 8.
        if min(width, height) < 64 or max(width, height) > 8 * min(width, height):
            raise ParamError(
                param, f"{param} must have sides of at least 64 and an aspect ratio up to 8, got {width}x{height}"
            )
        if width * height > self.max_context_area:  # `_resize_to_target_area`'s arithmetic
            scale = math.sqrt(self.max_context_area / (width * height))
            width, height = int(width * scale), int(height * scale)
        m = self.caps.size_multiple
        return width // m * m, height // m * m


class UlyssesFlux2AttnProcessor:
    """FLUX.2's double-stream attention (diffusers `Flux2AttnProcessor`) with this rank's image shard: [text, image
    shard] attend over the whole sequence through the Ulysses all-to-all. Layout [B, L, H, d]."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))
        eq, ek, ev = (x.unflatten(-1, (-1, attn.head_dim)) for x in (eq, ek, ev))
        q = torch.cat([attn.norm_added_q(eq), attn.norm_q(q)], dim=1)
        k = torch.cat([attn.norm_added_k(ek), attn.norm_k(k)], dim=1)
        v = torch.cat([ev, v], dim=1)
        out = _attend(self.g, q, k, v, image_rotary_emb, self._attention_backend)  # [B, T + S_local, H * d]
        text, image = out.split_with_sizes(
            [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1
        )
        return attn.to_out[1](attn.to_out[0](image)), attn.to_add_out(text)


class UlyssesFlux2SingleAttnProcessor:
    """FLUX.2's single-stream block (diffusers `Flux2ParallelSelfAttnProcessor`: fused QKV + MLP in, one projection
    out) over [text, this rank's image shard]; only the attention crosses ranks."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        out = _attend(self.g, attn.norm_q(q), attn.norm_k(k), v, image_rotary_emb, self._attention_backend)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def _attend(g: UlyssesGroup, q, k, v, rotary, backend) -> torch.Tensor:
    """[B, T + S_local, H, d] with the text first -> rotated, attended over the whole sequence -> [B, T + S_local,
    H * d] in the queries' dtype."""
    from diffusers.models.transformers.transformer_flux2 import apply_rotary_emb

    if rotary is not None:  # the text's angles and this rank's image angles (the ids were sharded)
        q = apply_rotary_emb(q, rotary, sequence_dim=1)
        k = apply_rotary_emb(k, rotary, sequence_dim=1)
    out = ulysses_sdpa(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        g,
        replicated=g.text_len,
        replicated_first=True,
        backend=backend,
    )
    return out.transpose(1, 2).flatten(2, 3).to(q.dtype)
