"""Ovis-Image (`OvisImagePipeline` checkpoints): FLUX.1's packed 2x2 latent patches and rotary position ids under its
own MMDiT, which takes no pooled text and no guidance embedding; prompts are read by a Qwen3 text encoder through a
chat template, padded to a fixed length (so every prompt has the same text length and any two requests of a size
share a forward). Its classifier-free guidance is on whenever `guidance_scale` > 1 (the negative prompt defaulting to
""), and reads `neg + scale * (pos - neg)`."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from diffusers import OvisImagePipeline

from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import packed_latent_size, request_generator, shift_mu
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache


class OvisImageAdapter(FlowMatchAdapter):
    spec = specs.OVIS_IMAGE
    vae_family = "flux"  # Ovis-Image decodes with FLUX.1's VAE
    # The pipeline's own defaults.
    default_steps = 50
    default_guidance = 5.0
    max_sequence_length = 256
    TEXT_ENCODERS = ("text_encoder",)

    def _step_cache(self) -> StepCache:
        cached = partial(forwards.ovis_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return OvisRequests(caps, declared, **parts)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return OvisImagePipeline._unpack_latents(latents, params.height, params.width, self.vae_scale_factor)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> (embeds [1, L, D],)
        config = self.pipe.scheduler.config
        channels = self.transformer.config.in_channels // 4
        states = []
        for i, (request_id, p) in enumerate(requests):
            (embeds,) = text[self.prompts.key(p.prompt, p)]
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            if getattr(config, "use_flow_sigmas", False):
                sigmas = None
            h, w = packed_latent_size(p, self.vae_scale_factor)
            generator = request_generator(p)
            sampler = self._sampler(p, generator, sigmas=sigmas, mu=shift_mu(config, (h // 2) * (w // 2)))
            latents, image_ids = self.pipe.prepare_latents(
                1, channels, p.height, p.width, embeds.dtype, self.device, generator
            )  # [1, seq, C * 4], [seq, 3]
            if cfg[i]:
                # Rows (positive, negative) per request; a batch interleaves them.
                (negative,) = text[p.negative_prompt or ""]
                cond = {
                    "embeds": torch.cat([embeds, negative]),
                    "scale": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32),
                    **self._guidance(p),
                }
            else:
                cond = {"embeds": embeds}
            shared = {"text_ids": self._text_ids(embeds), "image_ids": image_ids}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, shared=shared))
        return states

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder, one batched call: each prompt's features [1, L, D], padded to the pipeline's
        fixed length (its padding zeroed, as the pipeline does)."""
        self._stage(*self.TEXT_ENCODERS)
        embeds = self.pipe._get_ovis_prompt_embeds(
            prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        # Rows cloned: a view would keep the whole batch tensor alive in the prompt cache.
        return [(embeds[i : i + 1].clone(),) for i in range(len(texts))]

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        cond = self._batched_cond(states)
        shared = states[0].shared  # one size and one text length across the batch (its key)
        latents = torch.cat([s.latents for s in states])  # [B, seq, C * 4]
        seq = latents.shape[1]
        if "context" in cond:  # an edit's image tokens follow the latents (LongCat-Image-Edit); their output is dropped
            latents = torch.cat([latents, cond["context"].to(latents.dtype)], dim=1)
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device, latents.dtype)  # [B]
        rows = cond["embeds"].shape[0] // len(states)  # 2 with CFG: (positive, negative) per request
        batched = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),  # [B * rows, seq (+ context), C * 4]
            "timestep": timestep.repeat_interleave(rows) / 1000,
            "encoder_hidden_states": cond["embeds"],
        }
        ids = {"txt_ids": shared["text_ids"], "img_ids": shared["image_ids"]}
        out = self.ranks.rows(rows, batched, ids, states)[:, :, :seq]  # [B, rows, seq, C * 4]
        if rows == 1:
            return out[:, 0]
        return self._guide(out[:, 0], out[:, 1], cond)

    def _guidance(self, params: SamplingParams) -> dict[str, torch.Tensor]:
        """A CFG request's conditioning beyond its rows and scale (tensors [1], concatenated along a batch)."""
        return {}

    def _guide(self, pos: torch.Tensor, neg: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """The guided prediction [B, seq, C * 4] from the positive and negative rows, as the pipeline combines them."""
        return neg + cond["scale"].to(pos.dtype).view(-1, 1, 1) * (pos - neg)

    def _text_ids(self, embeds: torch.Tensor) -> torch.Tensor:
        """The text tokens' rotary ids [L, 3], as the pipeline builds them: (0, i, i) for token i, in the text's
        dtype."""
        ids = torch.zeros(embeds.shape[1], 3, device=embeds.device)
        position = torch.arange(embeds.shape[1], device=embeds.device)
        ids[:, 1] = position
        ids[:, 2] = position
        return ids.to(embeds.dtype)


class OvisRequests(RequestRules):
    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance`.
        return (params.guidance_scale or 0.0) > 1
