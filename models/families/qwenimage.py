"""Qwen-Image (`QwenImagePipeline` checkpoints): an MMDiT on packed 2x2 latent patches, a Qwen2.5-VL text encoder
whose prompts keep their own length, and true CFG (`true_cfg_scale` > 1 with a negative prompt) whose combined
prediction is rescaled to the norm of the conditional one, token by token.

The pipeline runs its conditional and unconditional branches as two forwards, each with its own text length; here
both rows of every request share one forward, their texts padded to the longest in the batch and masked
(`encoder_hidden_states_mask`), which the transformer's attention and rotary positions honour.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

from diffusiond.kernels.ulysses import UlyssesGroup, gather_output, ulysses_sdpa
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import packed_latent_size, request_generator, shift_mu
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache


class QwenImageAdapter(FlowMatchAdapter):
    spec = specs.QWEN_IMAGE
    # The pipeline's own defaults: 50 steps, true CFG at 4 when a negative prompt is given.
    default_steps = 50
    default_guidance = 1.0  # the distilled guidance embedding, which only guidance-distilled checkpoints have
    max_sequence_length = 512
    TEXT_ENCODERS = ("text_encoder",)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def _latent_channels(self) -> int:
        return self.vae.config.z_dim

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return QwenImageRequests(caps, declared, **parts)

    def _step_cache(self) -> StepCache:
        # Its cached forward does not shard tokens yet: --cache with --ulysses is refused at start.
        cached = partial(forwards.qwen_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        # [B, seq, C * 4] -> [B, C, 1, h, w] -> one frame [B, C, h, w]
        return QwenImagePipeline._unpack_latents(latents, params.height, params.width, self.vae_scale_factor)[:, :, 0]

    def _normalisation(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The video VAE's per-channel latent mean and 1 / std, [1, C, 1, 1, 1], as the pipelines build them."""
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
        return mean, std

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> the VAE's output [B, 3, H, W], the pipeline's de-normalisation step for step."""
        latents = latents.unsqueeze(2).to(self.vae.dtype)  # [B, C, 1, h, w]: the video VAE's one frame
        mean, std = self._normalisation(latents)
        return self.vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]

    def _encode_image(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[B, 3, H, W] -> normalised latents [B, 1, C, h, w] (frame first), as QwenImageImg2ImgPipeline has them
        when it draws the noise."""
        latents = retrieve_latents(self.vae.encode(image.unsqueeze(2).to(self.vae.dtype)), generator=generator)
        mean, std = self._normalisation(latents)
        return ((latents - mean) * std).transpose(1, 2)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> ([L, D],)
        channels = self.transformer.config.in_channels // 4
        states = []
        for i, (request_id, p) in enumerate(requests):
            embeds = text[p.prompt][0]
            h, w = packed_latent_size(p, self.vae_scale_factor)
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            generator = request_generator(p)
            sampler = self._sampler(
                p, generator, sigmas=sigmas, mu=shift_mu(self.pipe.scheduler.config, (h // 2) * (w // 2))
            )
            inpaint = None
            if p.image is None:
                latents = self.pipe.prepare_latents(
                    1, channels, p.height, p.width, embeds.dtype, self.device, generator
                )  # [1, seq, C * 4]
            else:
                noised, inpaint = self.images.noised(
                    p, sampler, generator, self.device, embeds.dtype
                )  # [1, 1, C, h, w]

                def pack(x: torch.Tensor, h=h, w=w) -> torch.Tensor:
                    return QwenImagePipeline._pack_latents(x, 1, channels, h, w)

                latents = pack(noised)
                inpaint = inpaint.map(pack) if inpaint is not None else None
            rows = [embeds]  # (positive, negative) per request; a batch interleaves them
            cond = {"guidance": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)}
            if cfg[i]:
                rows.append(text[p.negative_prompt or ""][0])
                cond["guidance"] = cond["guidance"].expand(2)
                cond["true_cfg"] = torch.full([1], p.true_cfg_scale, device=self.device, dtype=torch.float32)
            patches = (1, p.height // self.vae_scale_factor // 2, p.width // self.vae_scale_factor // 2)
            shared = {"img_shapes": [[patches]]}  # the transformer reads the first entry only
            states.append(
                RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, shared=shared, inpaint=inpaint)
            )
        return states

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder, one batched call: each prompt's embeddings without padding [L, D]."""
        self._stage(*self.TEXT_ENCODERS)
        embeds, mask = self.pipe.encode_prompt(
            prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        lengths = mask.sum(dim=1).tolist() if mask is not None else [embeds.shape[1]] * len(texts)
        return [(embeds[i, :n].clone(),) for i, n in enumerate(lengths)]

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        cond = self._batched_cond(states)
        rows = len(states[0].rows)  # 2 with true CFG (batch key)
        latents = torch.cat([s.latents for s in states])  # [B, seq, C * 4]
        seq = latents.shape[1]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device, latents.dtype)  # [B]
        if "context" in cond:  # an edit's image tokens follow the latents (Qwen-Image-Edit); their output is dropped
            latents = torch.cat([latents, cond["context"].to(latents.dtype)], dim=1)
        batched: dict[str, Any] = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),  # [B * rows, seq (+ ctx), C * 4]
            "timestep": timestep.repeat_interleave(rows) / 1000,
            "encoder_hidden_states": cond["texts"],  # [B * rows, L, D]
        }
        if "text_mask" in cond:
            batched["encoder_hidden_states_mask"] = cond["text_mask"]  # [B * rows, L]
        if self.transformer.config.guidance_embeds:
            batched["guidance"] = cond["guidance"]
        if getattr(self.transformer.config, "use_additional_t_cond", False):
            # Qwen-Image-Layered's RGB/RGBA embedding, indexed 0 for every row as the pipeline's call sends it.
            batched["additional_t_cond"] = torch.zeros(len(states) * rows, dtype=torch.long, device=self.device)
        out = self.ranks.rows(rows, batched, states[0].shared, states)[:, :, :seq]  # [B, rows, seq, C * 4]
        if rows == 1:
            return out[:, 0]
        return self._true_cfg(out[:, 0], out[:, 1], cond)

    def _true_cfg(self, pos: torch.Tensor, neg: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """True CFG, the combined prediction rescaled to the conditional one's norm, token by token; where the
        requests carry `renorm` (Qwen-Image-Layered's `cfg_normalize`, off by default), only the rows that ask."""
        scale = cond["true_cfg"].to(pos.dtype).view(-1, 1, 1)  # [B, 1, 1], built once per batch membership
        combined = neg + scale * (pos - neg)
        rescaled = combined * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        if "renorm" in cond:
            return torch.where(cond["renorm"].view(-1, 1, 1) > 0, rescaled, combined)
        return rescaled

    def _batched_rows(self, states: Sequence[RequestState]) -> dict[str, Any]:
        """Texts padded to the batch's longest [B * rows, L, D], with a mask when any is shorter."""
        texts = [t for s in states for t in s.rows]  # B * rows tensors [L_i, D]
        longest = max(t.shape[0] for t in texts)
        batched = {"texts": torch.stack([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[0])) for t in texts])}
        if any(t.shape[0] < longest for t in texts):
            mask = torch.zeros(len(texts), longest, dtype=torch.bool, device=self.device)
            for i, t in enumerate(texts):
                mask[i, : t.shape[0]] = True
            batched["text_mask"] = mask
        return batched

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        self.ranks.ulysses = group
        self.transformer.set_attn_processor(UlyssesQwenAttnProcessor(group))

        def shard_inputs(module, args, kwargs):
            # Image tokens are sharded (their rotary angles in the processor); the text stays whole on every rank.
            start, stop = group.split(kwargs["hidden_states"].shape[1])
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"][:, start:stop]}

        def shard_modulation(module, args, kwargs):
            # Edit-2511 (`zero_cond_t`): which modulation each image token takes (the noise's, or timestep 0's for
            # the input images' tokens), [B, S], sharded with the tokens.
            index = kwargs.get("modulate_index")
            if index is None:
                return None
            return args, {**kwargs, "modulate_index": index[:, group.span()]}

        self.transformer.register_forward_pre_hook(shard_inputs, with_kwargs=True)
        for block in self.transformer.transformer_blocks:
            block.register_forward_pre_hook(shard_modulation, with_kwargs=True)
        gather_output(self.transformer.proj_out, group)


class QwenImageRequests(RequestRules):
    default_true_cfg = 4.0  # the pipeline's, when a negative prompt is given

    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_true_cfg`.
        return (params.true_cfg_scale or 0.0) > 1 and params.negative_prompt is not None


class UlyssesQwenAttnProcessor:
    """Qwen-Image's joint attention (diffusers `QwenDoubleStreamAttnProcessor2_0`) with the image tokens sharded
    across `g`: each rank projects its shard, rotates it by its slice of the image's rotary angles, and attends over
    the whole [text, image] sequence through the Ulysses all-to-all, text padding masked as on one rank."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        img_freqs, txt_freqs = image_rotary_emb
        total = img_freqs.shape[0]  # the whole image's tokens
        start, stop = self.g.split(total)
        head_dim = attn.inner_dim // attn.heads
        img = [f(hidden_states).unflatten(-1, (-1, head_dim)) for f in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [
            f(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        ]
        img[0], img[1] = attn.norm_q(img[0]), attn.norm_k(img[1])
        txt[0], txt[1] = attn.norm_added_q(txt[0]), attn.norm_added_k(txt[1])
        for x in (img, txt):
            freqs = img_freqs[start:stop] if x is img else txt_freqs
            x[0], x[1] = (apply_rotary_emb_qwen(t, freqs, use_real=False) for t in x[:2])
        mask = None
        if encoder_hidden_states_mask is not None:
            image_mask = encoder_hidden_states_mask.new_ones((encoder_hidden_states_mask.shape[0], total))
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        seq_txt = encoder_hidden_states.shape[1]
        q, k, v = (torch.cat([t, i], dim=1).transpose(1, 2) for t, i in zip(txt, img, strict=True))  # [B, H, L, d]
        out = ulysses_sdpa(
            q, k, v, self.g, replicated=seq_txt, replicated_first=True, backend=self._attention_backend, attn_mask=mask
        )
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)  # [B, T + S_local, D]
        txt_out, img_out = out[:, :seq_txt], out[:, seq_txt:]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())
