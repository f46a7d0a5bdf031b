"""GLM-Image (`GlmImagePipeline` checkpoints): an autoregressive prior and a DiT. For each request the prior (a
`GlmImageForConditionalGeneration`, read through its processor's chat template) samples the image's tokens on a
32-pixel grid, seeded by the request's seed as the pipeline seeds it (torch's global generator, forked here so that
nothing else's draws move); the tokens, upsampled 2x, condition every DiT step beside the glyph embeddings of the
prompt's quoted text (a ByT5 T5 encoder). CFG whenever `guidance_scale` > 1: the negative row drops the prior tokens
and reads the empty prompt's glyphs (the pipeline takes no negative prompt). The schedule is the pipeline's own:
linear timesteps handed to the DiT unshifted, their sigmas shifted by the image's size.

The prior's tokens are part of a prompt's encoding, keyed by its text, size and seed (models/flowmatch/prompts.py):
on several ranks rank 0 samples them once and the others receive them.

Batching. The DiT takes no text mask (the pipeline pads nothing: it encodes one prompt a call), so a row may share a
call only with rows whose glyphs have the same length: each step groups the batch's rows (a request's positive and
negative rows too) by glyph length and runs one call per group. On several ranks: CFG-parallel (each rank one row
of every CFG request, or half of a batch's requests without it) and tensor parallelism (each block's attention
heads and feed-forward columns). Step caches (fbcache, DBCache, x0cache) decide per row (`cached_forward`). Not
served: condition images (the pipeline's image-to-image, through the DiT's KV
cache), which diffusers 0.42.1's call itself fails on with transformers 5.25 (no oracle; docs/families.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift

from diffusiond.models.base import Capabilities, RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.prompts import Prompts
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import request_generator
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.forwards import lora_narrows
from diffusiond.models.stepcache.methods import Batch, Method, cached_blocks, settle
from diffusiond.models.stepcache.span import RowState, TextFirst, sigmas, spanned

# The pipeline hands its processor the target size as plain keyword arguments, which transformers 5.25 warns about at
# every call: nothing a deployment can act on, dropped from its log.
logging.getLogger("transformers.processing_utils").addFilter(
    lambda record: not record.getMessage().startswith("Kwargs passed to `processor.__call__`")
)
_PRIOR = "\x01"  # a prompt key that also samples the prior's tokens: "\x01{width}x{height}:{seed}\x00{prompt}"


class GlmImageAdapter(FlowMatchAdapter):
    spec = specs.GLM_IMAGE
    # The pipeline's own defaults (its call needs a size for a text-to-image request: the DiT's 128 latents a side).
    default_steps = 50
    default_guidance = 1.5
    max_sequence_length = 2048
    TEXT_ENCODERS = ("text_encoder", "vision_language_encoder")

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size * 2  # the prior's 32-pixel grid

    def _capabilities(self) -> Capabilities:
        return dataclasses.replace(super()._capabilities(), supports_negative_prompt=False)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return GlmImageRequests(caps, declared, **parts)

    def _prompts(self) -> Prompts:
        return PriorPrompts(self._encode, self.requests.uses_cfg)

    def _step_cache(self) -> StepCache:
        cached = partial(cached_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _tp_plan(self) -> dict[str, str]:
        """diffusers 0.42 has none for GLM-Image: each block's attention projections (column-wise: whole heads, each
        with its q/k norm) and its feed-forward, which reads the image and the glyph tokens alike. The adaptive
        norms, embedders and projectors stay whole."""
        plan = {}
        for i, _ in enumerate(self.transformer.transformer_blocks):
            for linear in ("to_q", "to_k", "to_v"):
                plan[f"transformer_blocks.{i}.attn1.{linear}"] = "colwise"
            plan[f"transformer_blocks.{i}.attn1.to_out.0"] = "rowwise"
            plan[f"transformer_blocks.{i}.ff.net.0.proj"] = "colwise"
            plan[f"transformer_blocks.{i}.ff.net.2"] = "rowwise"
        return plan

    def _after_tp(self, degree: int) -> None:
        for block in self.transformer.transformer_blocks:
            block.attn1.heads //= degree  # its processor splits heads by `attn.heads`

    # ---- prompts ----

    def _encode(self, keys: list[str]) -> list[tuple[torch.Tensor, ...]]:
        """Each key's glyph embeddings [1, L, D] (the pipeline encodes one prompt a call: no padding), and for a
        prompt key (`PriorPrompts`) the prior's tokens [1, seq] for its size and seed, as the pipeline samples them."""
        self._stage(*self.TEXT_ENCODERS)
        out = []
        for key in keys:
            head, _, text = key.partition("\x00") if key.startswith(_PRIOR) else ("", "", key)
            glyphs = self.pipe._get_glyph_embeds([text], self.max_sequence_length, self.device, self.dtype)
            if not head:
                out.append((glyphs,))
                continue
            size, _, seed = head[1:].partition(":")
            width, height = (int(x) for x in size.split("x"))
            out.append((glyphs, self._prior_tokens(text, width, height, int(seed))))
        return out

    def _prior_tokens(self, text: str, width: int, height: int, seed: int) -> torch.Tensor:
        """The prior's image tokens [1, (height / 16) * (width / 16)]: the pipeline's own sampling, which seeds
        torch's global generator with the request's seed; forked, so that it moves no other draw."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            ids, _, _ = self.pipe.generate_prior_tokens(
                prompt=text,
                height=height,
                width=width,
                device=self.device,
                generator=torch.Generator().manual_seed(seed),
            )
        return ids

    # ---- requests ----

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)
        channels = self.transformer.config.in_channels
        p_size = self.transformer.config.patch_size
        config = self.pipe.scheduler.config
        states = []
        for i, (request_id, p) in enumerate(requests):
            glyphs, prior = text[self.prompts.key(p.prompt, p)]
            generator = request_generator(p)
            latents = self.pipe.prepare_latents(
                1, channels, p.height, p.width, glyphs.dtype, self.device, generator
            )  # [1, C, h, w]
            steps = p.num_inference_steps
            timesteps = np.linspace(config.num_train_timesteps, 1.0, steps + 1)[:-1]
            timesteps = timesteps.astype(np.int64).astype(np.float32)
            seq = (p.height // self.vae_scale_factor) * (p.width // self.vae_scale_factor) // p_size**2
            mu = calculate_shift(
                seq,
                config.get("base_image_seq_len", 256),
                config.get("base_shift", 0.25),
                config.get("max_shift", 0.75),
            )
            sampler = self._sampler(p, generator, sigmas=timesteps / config.num_train_timesteps, mu=mu)
            # The DiT reads the timesteps unshifted (the pipeline hands the scheduler both): only its sigmas move.
            sampler.timesteps = torch.from_numpy(timesteps).to(self.device)
            rows = [glyphs]  # (positive, negative) with CFG
            cond = {"prior": prior}
            if cfg[i]:
                (negative,) = text[self.prompts.negative_key("", p)]
                rows.append(negative)
                cond["scale"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            shared = {"target_size": torch.tensor([[p.height, p.width]], dtype=glyphs.dtype, device=self.device)}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, shared=shared))
        return states

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        latents = torch.cat([s.latents for s in states]).to(self.transformer.dtype)  # [B, C, h, w]
        # The pipeline's `t.expand(B) - 1`.
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device) - 1  # [B]
        rows = len(states[0].rows)  # 2 with CFG (batch key)
        out = self.ranks.members(
            len(states), rows, lambda members: self._predict(states, latents, timestep, members)
        )  # [B, rows, C, h, w]
        if rows == 1:
            return out[:, 0]
        scale = torch.cat([s.cond["scale"] for s in states]).view(-1, 1, 1, 1)
        pos, neg = out[:, 0], out[:, 1]
        return neg + scale * (pos - neg)

    def _predict(self, states, latents, timestep, members: list[tuple[int, int]]) -> torch.Tensor:
        """The DiT's output (float32, as the pipeline's) for `members` ((request, row) pairs), [len, C, h, w] in
        their order: rows whose glyphs have one length share a call (row 1, the negative, without the prior)."""
        groups: dict[int, list[int]] = {}
        for k, (i, r) in enumerate(members):
            groups.setdefault(states[i].rows[r].shape[1], []).append(k)
        out = latents.new_empty(len(members), *latents.shape[1:], dtype=torch.float32)
        for ks in groups.values():
            pairs = [members[k] for k in ks]
            index = torch.tensor([i for i, _ in pairs], device=self.device)
            prior = torch.cat([states[i].cond["prior"] for i, _ in pairs])
            drop = torch.tensor([r == 1 for _, r in pairs], device=self.device)[:, None].expand_as(prior)
            target = torch.cat([states[i].shared["target_size"] for i, _ in pairs])
            batched = {
                "hidden_states": latents[index],
                "encoder_hidden_states": torch.cat([states[i].rows[r] for i, r in pairs]),
                "prior_token_id": prior,
                "prior_token_drop": drop.contiguous(),
                "timestep": timestep[index],
                "target_size": target,
                "crop_coords": torch.zeros_like(target),  # the pipeline's default (0, 0): no request sets it
            }
            # A step cache's rows: each its own (a request's rows may run in calls of different glyph lengths).
            rows = [RowState(states[i], r, r == 0) for i, r in pairs]
            with self.loras.rows([self.loras.of(states[i]) for i, _ in pairs]):
                pred = self.cache.forward(batched, {}, 1, rows)
            out[torch.tensor(ks, device=self.device)] = pred.float()
        return out

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's: its VAE's per-channel latent statistics undone, then decoded."""
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents.device, self.vae.dtype)
        std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents.device, self.vae.dtype)
        latents = latents.to(self.vae.dtype) * std + mean
        return self.vae.decode(latents, return_dict=False)[0]


@torch.inference_mode()
def cached_forward(
    method: Method, batched: dict[str, Any], shared: dict[str, Any], rows: int, states: Sequence[Any], *, transformer
) -> torch.Tensor:
    """One DiT call with a step cache decision per row (`states`: `RowState`s): the transformer's own forward, its
    blocks run by `cached_blocks` (models/stepcache/span.py). The image tokens are the cached stream; the glyph
    tokens, which the dual-stream blocks change too, are kept for DBCache's last blocks."""
    with spanned(transformer, partial(_cached_blocks, method, states, lora_narrows(transformer))):
        out = transformer(**batched, **shared, return_dict=False)[0]
    return settle(method, out, batched["hidden_states"], sigmas(states), rows, states)


def _cached_blocks(method: Method, states, narrows, blocks, hidden_states, text, temb, *rest, **_):
    """The blocks as the forward calls them (positionally: image, glyphs, temb, then rotary angles, a text mask (None)
    and attention kwargs; no KV cache without condition images)."""
    extra = dict(zip(("image_rotary_emb", "attention_mask", "attention_kwargs"), rest, strict=True))
    batch = Batch(hidden_states, text, temb, 1, states, {}, narrows, extra)
    return cached_blocks(method, [TextFirst(b) for b in blocks], batch), text  # the glyphs after them: unused


class PriorPrompts(Prompts):
    """A request's prompt key carries its size and seed (the prior's tokens depend on them); its negative is the
    empty prompt's glyphs alone, whatever the request."""

    def key(self, text: str, params: SamplingParams) -> str:
        return f"{_PRIOR}{params.width}x{params.height}:{params.seed}\x00{text}"

    def negative_key(self, text: str, params: SamplingParams) -> str:
        return ""


class GlmImageRequests(RequestRules):
    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance`.
        return (params.guidance_scale or 0.0) > 1

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if params.negative_prompt is not None:
            raise ParamError(
                "negative_prompt",
                f"the {self.family} pipeline takes no negative prompt: its negative branch reads the empty prompt "
                "and drops the prior's tokens",
            )
        return super().resolve(params)
