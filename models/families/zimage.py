"""Z-Image (`ZImagePipeline` checkpoints): a single-stream DiT that takes its latents and caption features as lists,
so prompts of any length share a forward without padding on our side. Its classifier-free guidance is on whenever
`guidance_scale` > 0 and reads `pos + scale * (pos - neg)`; the transformer predicts the negated velocity.

The distilled Turbo checkpoints run at `guidance_scale` 0 (one row per request) and 8-9 steps: a checkpoint says so in
`diffusiond.json` (models/declared.py), since `model_index.json` cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from diffusiond.kernels.ulysses import UlyssesGroup, gather_output, ulysses_sdpa
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import packed_latent_size, request_generator, shift_mu
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache


class ZImageAdapter(FlowMatchAdapter):
    spec = specs.Z_IMAGE
    vae_family = "flux"  # Z-Image decodes with FLUX.1's VAE
    # The pipeline's own defaults.
    default_steps = 50
    default_guidance = 5.0
    max_sequence_length = 512
    TEXT_ENCODERS = ("text_encoder",)

    def _default_size(self) -> tuple[int, int]:
        return 1024, 1024

    def _tp_plan(self) -> dict[str, str]:
        """diffusers 0.42 has none for Z-Image: every layer's attention projections (column-wise: whole heads, each
        with its q/k norm) and its SwiGLU feed-forward (w1, w3 column-wise, w2 row-wise), in the refiners and the
        main layers alike. The modulations, embedders and final layer stay whole."""
        plan = {}
        for stack in ("noise_refiner", "context_refiner", "layers"):
            for i, _ in enumerate(getattr(self.transformer, stack)):
                for linear in ("to_q", "to_k", "to_v"):
                    plan[f"{stack}.{i}.attention.{linear}"] = "colwise"
                plan[f"{stack}.{i}.attention.to_out.0"] = "rowwise"
                plan[f"{stack}.{i}.feed_forward.w1"] = "colwise"
                plan[f"{stack}.{i}.feed_forward.w3"] = "colwise"
                plan[f"{stack}.{i}.feed_forward.w2"] = "rowwise"
        return plan

    def _after_tp(self, degree: int) -> None:
        from diffusers.models.attention_processor import Attention

        for module in self.transformer.modules():
            if isinstance(module, Attention):  # its processor splits heads by `attn.heads`
                module.heads //= degree

    def _step_cache(self) -> StepCache:
        # Its cached forward runs the transformer's own with the main layers stood in for (forwards.zimage_forward);
        # its Ulysses hooks shard around those layers: --cache with --ulysses is refused at start.
        cached = partial(forwards.zimage_forward, transformer=self.transformer, call=self._call)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        """The main layers' unified sequence ([image, caption], padded per batch) is sharded across `group`, with its
        rotary angles; each attention all-to-alls to whole sequences of its heads, the padding mask kept whole. The
        refiners before (image and caption apart) run whole on every rank."""
        self.ranks.ulysses = group
        layers = self.transformer.layers
        span: dict[str, int] = {}

        def shard(module, args):
            x, mask, freqs, *rest = args  # the layers are called positionally
            if module is layers[0]:
                span["start"], span["stop"] = group.split(x.shape[1])
                x = x[:, span["start"] : span["stop"]]
            return (x, mask, freqs[:, span["start"] : span["stop"]], *rest)

        for layer in layers:
            layer.attention.set_processor(UlyssesZImageAttnProcessor(group))
            layer.register_forward_pre_hook(shard)
        gather_output(layers[-1], group)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return ZImageRequests(caps, declared, **parts)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> ([L, D],)
        states = []
        for i, (request_id, p) in enumerate(requests):
            h, w = packed_latent_size(p, self.vae_scale_factor)
            sigmas = get_default_z_image_sigmas(p.num_inference_steps)
            generator = request_generator(p)
            sampler = self._sampler(
                p, generator, sigmas=sigmas, mu=shift_mu(self.pipe.scheduler.config, (h // 2) * (w // 2))
            )
            inpaint = None
            if p.image is None:
                # float32 whatever the transformer's dtype, as the pipeline keeps them.
                latents = self.pipe.prepare_latents(
                    1, self.transformer.in_channels, p.height, p.width, torch.float32, self.device, generator
                )  # [1, C, h, w]
            else:
                # The text features' dtype, as ZImageImg2ImgPipeline draws them.
                latents, inpaint = self.images.noised(p, sampler, generator, self.device, text[p.prompt][0].dtype)
            # Rows (positive, negative) per request; a batch interleaves them.
            rows = [text[p.prompt][0]]
            cond = {}
            if cfg[i]:
                rows.append(text[p.negative_prompt or ""][0])
                cond["scale"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, inpaint=inpaint))
        return states

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder, one batched call: each prompt's features without its padding [L, D]."""
        self._stage(*self.TEXT_ENCODERS)
        # A copy: the pipeline writes the chat-formatted prompts into the list it is given.
        embeds = self.pipe._encode_prompt(list(texts), device=self.device, max_sequence_length=self.max_sequence_length)
        return [(e.clone(),) for e in embeds]

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        rows = len(states[0].rows)  # the batch key holds CFG on or off: 2 rows per request or 1
        latents = torch.cat([s.latents for s in states]).to(self.dtype)  # [B, C, h, w]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device)  # [B]
        batched = {
            "hidden_states": latents.unsqueeze(2).repeat_interleave(rows, dim=0),  # [B * rows, C, 1, h, w]
            "timestep": ((1000 - timestep) / 1000).repeat_interleave(rows),
            "cap_feats": self._batched_cond(states)["cap_feats"],
        }
        out = self.ranks.rows(rows, batched, {}, states).float().squeeze(3)  # [B, rows, C, h, w]
        if rows == 1:
            return -out[:, 0]
        pos, neg = out[:, 0], out[:, 1]
        scale = self._batched_cond(states)["scale"]  # [B], built once per batch membership
        return -(pos + scale.view(-1, 1, 1, 1) * (pos - neg))

    def _batched_rows(self, states: Sequence[RequestState]) -> dict[str, Any]:
        return {"cap_feats": [t for s in states for t in s.rows]}  # B * rows tensors [L_i, D]

    def _call(self, batched: dict[str, Any], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.transformer(
            list(batched["hidden_states"].unbind(0)), batched["timestep"], batched["cap_feats"], return_dict=False
        )[0]  # a list of [C, 1, h, w]
        return torch.stack(out)  # [rows, C, 1, h, w]


class ZImageRequests(RequestRules):
    default_inpaint_strength = 1.0  # ZImageInpaintPipeline's

    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance` (the truncation it may apply is off by default).
        return (params.guidance_scale or 0.0) > 0


class UlyssesZImageAttnProcessor:
    """Z-Image's single-stream attention (diffusers `ZSingleStreamAttnProcessor`) over a sequence sharded across `g`:
    each rank projects and rotates its tokens, then attends over the whole sequence of its heads."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        q, k, v = (f(hidden_states).unflatten(-1, (attn.heads, -1)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if freqs_cis is not None:
            q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]  # [B, 1, 1, S]: keys, the whole sequence
        out = ulysses_sdpa(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            self.g,
            replicated=0,
            replicated_first=True,
            backend=self._attention_backend,
            attn_mask=attention_mask,
        ).transpose(1, 2)  # [B, S_local, H, d]
        out = attn.to_out[0](out.flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's rotary embedding, as its processor applies it (complex product in float32)."""
    with torch.amp.autocast("cuda", enabled=False):
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)
