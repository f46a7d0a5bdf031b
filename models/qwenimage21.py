"""Qwen-Image 2.1 (`QwenImage21Pipeline` checkpoints), text to image: a Qwen3-VL text encoder (its last layer before
the final norm, the system message's tokens dropped), one single-stream block-causal transformer over [text, image]
on unpatched latents of a 16x VAE that decodes RGBA, and true CFG (`true_cfg_scale` > 1 with a negative prompt; the
checkpoint is meant to be sampled without, hence the default 1.0).

Batching. The transformer lays out every row of a call as its first row (the text's rotary positions run into the
image's frame index, and `img_mask` and `img_shapes` are read from row 0), so a padded shorter prompt would move its
image: a row may share a call only with rows whose text has the same length. Each step groups the batch's rows (a
request's positive and negative rows too) by text length and runs one transformer call per group: requests of one
prompt, `n` > 1 copies, and prompts of equal length share forwards; others run in the same step, in calls of their
own. The pipeline's prefix KV cache (text keys and values computed once, at the first step) is not used: the
prefix is computed again at every step, which gives the same images (measured: equal in fp32) at the cost of the
text's share of each forward.

Not served yet: image-conditioned generation (edits), LoRA, step caches, parallel strategies, and checkpoints that
fix their schedule (`sample_sigmas`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from diffusers import QwenImage21Pipeline

from diffusiond.models import families
from diffusiond.models.base import RequestState
from diffusiond.models.flowmatch import FlowMatchAdapter
from diffusiond.models.params import SamplingParams


class QwenImage21Adapter(FlowMatchAdapter):
    spec = families.QWEN_IMAGE_21
    # The pipeline's own defaults: 40 steps, no guidance unless asked (true CFG with a negative prompt), 1024x1024.
    default_steps = 40
    default_guidance = 1.0  # no guidance embedding: `guidance_scale` is refused unless left at this
    default_true_cfg = 1.0
    output_resolution = 1024
    TEXT_ENCODERS = ("text_encoder",)

    def __init__(self, pipe, *, source: str, lazy=None) -> None:
        if pipe.config.get("sample_sigmas") is not None:
            raise ValueError(f"{source}: a fixed sampling schedule (`sample_sigmas`) is not served yet")
        super().__init__(pipe, source=source, lazy=lazy)

    def _vae_scale_factor(self, pipe) -> int:
        return pipe.vae_scale_factor  # 16: one latent token per 16x16 pixels, unpatched

    def _default_size(self) -> tuple[int, int]:
        return self.output_resolution, self.output_resolution

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2  # the pipeline floors sides to it

    def _latent_channels(self) -> int:
        return self.vae.config.z_dim

    def _uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_true_cfg`.
        return (params.true_cfg_scale or 0.0) > 1 and params.negative_prompt is not None

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder, one batched call (left-padded, as the pipeline): each prompt's embeddings
        without padding [L, D]."""
        self._stage(*self.TEXT_ENCODERS)
        embeds, mask, _ = self.pipe.encode_prompt(prompt=list(texts), device=self.device)
        lengths = mask.sum(dim=1).tolist() if mask is not None else [embeds.shape[1]] * len(texts)
        return [(embeds[i, :n].clone(),) for i, n in enumerate(lengths)]

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self._lookup_prompts(params)  # text -> ([L, D],)
        channels = self.transformer.config.in_channels
        states = []
        for i, (request_id, p) in enumerate(requests):
            (embeds,) = text[p.prompt]
            generator = self._generator(p)
            latents, _ = self.pipe.prepare_latents(
                None, 1, channels, p.height, p.width, embeds.dtype, self.device, generator
            )  # [1, seq, C]
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            sampler = self._sampler(p, generator, sigmas=sigmas, mu=self._shift_mu(latents.shape[1]))
            rows = [embeds]  # (positive, negative) with true CFG
            cond = {}
            if cfg[i]:
                rows.append(text[p.negative_prompt][0])
                cond["true_cfg"] = torch.full([1], p.true_cfg_scale, device=self.device, dtype=torch.float32)
            grid = (1, p.height // self.vae_scale_factor, p.width // self.vae_scale_factor)
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, shared={"grid": grid}))
        return states

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        latents = torch.cat([s.latents for s in states]).to(self.transformer.dtype)  # [B, seq, C]
        seq = latents.shape[1]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device, latents.dtype) / 1000  # [B]
        rows = len(states[0].rows)  # 2 with true CFG (batch key)
        by_length: dict[int, list[tuple[int, int]]] = {}  # text length -> (request, row) of the rows that have it
        for i, state in enumerate(states):
            for r, embeds in enumerate(state.rows):
                by_length.setdefault(embeds.shape[0], []).append((i, r))
        out = latents.new_empty(len(states), rows, seq, latents.shape[2])
        grid = states[0].shared["grid"]  # one size per batch (batch key)
        for length, members in by_length.items():
            index = torch.tensor([i for i, _ in members], device=self.device)
            n = len(members)
            # Text slots, then one image slot per 2x2 latent tokens: the same layout on every row of the call.
            img_mask = torch.ones(n, length + seq // 4, dtype=torch.bool, device=self.device)
            img_mask[:, :length] = False
            batched = {
                "hidden_states": latents[index],
                "timestep": timestep[index],
                "encoder_hidden_states": torch.stack([states[i].rows[r] for i, r in members]),
            }
            pred = self._call(batched, {"img_shapes": [[grid]] * n, "img_mask": img_mask})[:, -seq:]
            for k, (i, r) in enumerate(members):
                out[i, r] = pred[k]
        if rows == 1:
            return out[:, 0]
        scale = torch.cat([s.cond["true_cfg"] for s in states]).to(out.dtype).view(-1, 1, 1)
        pos, neg = out[:, 0], out[:, 1]
        return neg + scale * (pos - neg)

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        # [B, seq, C] -> [B, C, 1, h, w] -> one frame [B, C, h, w]
        return QwenImage21Pipeline._unpack_latents(latents, params.height, params.width, self.vae_scale_factor)[:, :, 0]

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> the VAE's RGBA output [B, 4, H, W], the pipeline's de-normalisation step for step."""
        latents = latents.unsqueeze(2).to(self.vae.dtype)  # the video VAE's one frame
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return self.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
