"""FLUX.1 (`FluxPipeline` checkpoints): packed 2x2 latent patches, rotary position ids, the distilled guidance
embedding (`guidance_scale`) and optional true CFG (`true_cfg_scale` > 1 with a negative prompt)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.models.embeddings import apply_rotary_emb

from diffusiond.kernels.ulysses import UlyssesGroup, gather_output, ulysses_sdpa
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import packed_latent_size, request_generator, shift_mu
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.settings import FLUX_TEACACHE


class FluxAdapter(FlowMatchAdapter):
    spec = specs.FLUX
    default_guidance = 3.5
    max_sequence_length = 512

    def _step_cache(self) -> StepCache:
        """TeaCache's polynomial and MagCache's ratios published for FLUX.1 [dev] (diffusers ships the ratios, for 28
        steps); a calibration beside the weights wins."""
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        cached = partial(forwards.flux_forward, transformer=self.transformer)
        ratios = tuple(float(r) for r in FLUX_MAG_RATIOS)
        return StepCache(self.family, self.cache_methods, self._call, cached, teacache=FLUX_TEACACHE, magcache=ratios)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return FluxRequests(caps, declared, **parts)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return FluxPipeline._unpack_latents(latents, params.height, params.width, self.vae_scale_factor)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> (embeds, pooled)
        config = self.pipe.scheduler.config
        channels = self.transformer.config.in_channels // 4
        states = []
        for i, (request_id, p) in enumerate(requests):
            embeds, pooled = text[p.prompt]  # [1, L, D], [1, D]
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            if getattr(config, "use_flow_sigmas", False):
                sigmas = None
            h, w = packed_latent_size(p, self.vae_scale_factor)
            generator = request_generator(p)
            sampler = self._sampler(
                p, generator, sigmas=sigmas, mu=shift_mu(self.pipe.scheduler.config, (h // 2) * (w // 2))
            )
            latents, image_ids, context, inpaint = self._initial_latents(p, sampler, generator, channels, embeds.dtype)
            guidance = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            if cfg[i]:
                # Rows (positive, negative) per request; a batch interleaves them.
                neg_embeds, neg_pooled = text[p.negative_prompt or ""]
                cond = {
                    "embeds": torch.cat([embeds, neg_embeds]),
                    "pooled": torch.cat([pooled, neg_pooled]),
                    "guidance": guidance.expand(2),
                    "true_cfg": torch.full([1], p.true_cfg_scale, device=self.device, dtype=torch.float32),
                }
            else:
                cond = {"embeds": embeds, "pooled": pooled, "guidance": guidance}
            if context is not None:
                cond["context"] = context
            # Text position ids are zeros [L, 3] whatever the text (the pipeline's own `encode_prompt` builds them).
            text_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=embeds.dtype)
            shared = {"text_ids": text_ids, "image_ids": image_ids}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, shared=shared, inpaint=inpaint))
        return states

    def _initial_latents(self, p: SamplingParams, sampler, generator, channels: int, dtype: torch.dtype):
        """(packed latents [1, seq, C * 4], rotary ids of every image token [seq_all, 3], packed context tokens
        [1, seq_ctx, C * 4] that follow the latents in the transformer's input or None, inpainting's Inpaint (packed)
        or None)."""
        if p.image is None:
            latents, image_ids = self.pipe.prepare_latents(
                1, channels, p.height, p.width, dtype, self.device, generator
            )
            return latents, image_ids, None, None
        h, w = packed_latent_size(p, self.vae_scale_factor)
        noised, inpaint = self.images.noised(p, sampler, generator, self.device, dtype)  # [1, C, h, w]

        def pack(x: torch.Tensor) -> torch.Tensor:
            return FluxPipeline._pack_latents(x, 1, channels, h, w)

        ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, dtype)
        return pack(noised), ids, None, inpaint.map(pack) if inpaint is not None else None

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._stage(*self.TEXT_ENCODERS)
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        # Rows cloned: a view would keep the whole batch tensor alive in the cache.
        return [(embeds[i : i + 1].clone(), pooled[i : i + 1].clone()) for i in range(len(texts))]

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        cond = self._batched_cond(states)
        shared = states[0].shared  # same size and text length across the batch (batch key)
        latents = torch.cat([s.latents for s in states])  # [B, seq, C * 4]
        seq = latents.shape[1]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device, latents.dtype)  # [B]
        rows = cond["embeds"].shape[0] // len(states)  # 2 with true CFG: (positive, negative) per request
        if "context" in cond:  # an edit's image tokens follow the latents (as FluxKontextPipeline's input)
            latents = torch.cat([latents, cond["context"]], dim=1)
        batched = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),  # [B * rows, seq (+ context), C * 4]
            "timestep": timestep.repeat_interleave(rows) / 1000,
            "pooled_projections": cond["pooled"],
            "encoder_hidden_states": cond["embeds"],
        }
        if self.transformer.config.guidance_embeds:
            batched["guidance"] = cond["guidance"]
        ids = {"txt_ids": shared["text_ids"], "img_ids": shared["image_ids"]}
        out = self.ranks.rows(rows, batched, ids, states)[:, :, :seq]  # [B, rows, seq, C * 4]
        if rows == 1:
            return out[:, 0]
        pos, neg = out[:, 0], out[:, 1]
        scale = cond["true_cfg"].to(out.dtype)  # [B], built once per batch membership
        return neg + scale.view(-1, 1, 1) * (pos - neg)

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        self.ranks.ulysses = group
        self.cache.cached = partial(forwards.flux_forward, transformer=self.transformer, ulysses=group)
        self.transformer.set_attn_processor(UlyssesFluxAttnProcessor(group))
        shard_image_tokens(self.transformer, group)


class FluxRequests(RequestRules):
    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_true_cfg`.
        return (params.true_cfg_scale or 0.0) > 1 and params.negative_prompt is not None


def shard_image_tokens(transformer: torch.nn.Module, group: UlyssesGroup) -> None:
    """FLUX-style transformers (FLUX.1, FLUX.2: `hidden_states`, `img_ids`, `encoder_hidden_states` keywords, a
    `proj_out`): image tokens and their rotary ids are sharded across `group` as the forward starts, the text stays
    whole (its length is the attention's replicated prefix), and the output is gathered after `proj_out`."""

    def shard_inputs(module, args, kwargs):
        hidden_states, img_ids = kwargs["hidden_states"], kwargs["img_ids"]
        start, stop = group.split(hidden_states.shape[1])
        group.text_len = kwargs["encoder_hidden_states"].shape[1]
        return args, {**kwargs, "hidden_states": hidden_states[:, start:stop], "img_ids": img_ids[start:stop]}

    transformer.register_forward_pre_hook(shard_inputs, with_kwargs=True)
    gather_output(transformer.proj_out, group)


class UlyssesFluxAttnProcessor:
    """FLUX attention (diffusers `FluxAttnProcessor`) with image tokens sharded across `g`. Layout [B, L, H, d]."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            encoder_query, encoder_key, encoder_value = (
                x.unflatten(-1, (-1, attn.head_dim)) for x in (encoder_query, encoder_key, encoder_value)
            )
            encoder_query, encoder_key = attn.norm_added_q(encoder_query), attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = ulysses_sdpa(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            self.g,
            replicated=self.g.text_len,
            replicated_first=True,
            backend=self._attention_backend,
        ).transpose(1, 2)  # [B, L_local, H, d]
        hidden_states = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states
