"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline` checkpoints): MMDiT on 2D latents, classifier-free guidance
with the negative branch first, as the pipeline batches it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.kernels.attention import DispatchJointAttnProcessor
from diffusiond.kernels.host import to_device
from diffusiond.kernels.ulysses import UlyssesGroup, gather_output, shard_output, ulysses_sdpa
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import request_generator, shift_mu
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache


class SD3Adapter(FlowMatchAdapter):
    spec = specs.SD3
    default_guidance = 7.0
    repeated_blocks = ("JointTransformerBlock",)  # diffusers 0.42's SD3 transformer names none
    # The pipeline's default T5 length; the text context length is fixed, so any prompts can share a batch.
    max_sequence_length = 256

    def _default_size(self) -> tuple[int, int]:
        side = self.transformer.config.sample_size * self.vae_scale_factor
        return side, side

    def _step_cache(self) -> StepCache:
        # Ulysses shards tokens through hooks on pos_embed and proj_out, which the cached forward calls as well.
        cached = partial(forwards.sd3_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return SD3Requests(caps, declared, blocks=self.transformer.config.num_layers, **parts)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size

    def _max_side(self) -> int:
        pos_embed_max_size = self.transformer.config.pos_embed_max_size
        if pos_embed_max_size is None:
            return super()._max_side()
        return pos_embed_max_size * self._size_multiple()

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> (embeds, pooled)
        config = self.pipe.scheduler.config
        states = []
        for i, (request_id, p) in enumerate(requests):
            shape = (
                1,
                self.transformer.config.in_channels,
                p.height // self.vae_scale_factor,
                p.width // self.vae_scale_factor,
            )  # [1, C, h, w]
            embeds, pooled = text[p.prompt]  # [1, L, D], [1, D]
            kwargs = {}
            if config.get("use_dynamic_shifting", None):
                patch = self.transformer.config.patch_size
                kwargs["mu"] = shift_mu(
                    self.pipe.scheduler.config, (shape[2] // patch) * (shape[3] // patch), max_shift=1.16
                )
            generator = request_generator(p)
            sampler = self._sampler(p, generator, **kwargs)
            inpaint = None
            if p.image is None:
                latents = randn_tensor(shape, generator=generator, device=self.device, dtype=embeds.dtype)
            else:
                latents, inpaint = self.images.noised(p, sampler, generator, self.device, embeds.dtype)
            if cfg[i]:
                # Rows (negative, positive) per request: a batch of them interleaves, one concatenation per batch.
                neg_embeds, neg_pooled = text[p.negative_prompt or ""]
                cond = {
                    "embeds": torch.cat([neg_embeds, embeds]),
                    "pooled": torch.cat([neg_pooled, pooled]),
                    "scale": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32),
                    "slg_scale": torch.full(
                        [1], p.skip_layer_guidance_scale or 0.0, device=self.device, dtype=torch.float32
                    ),
                }
            else:
                cond = {"embeds": embeds, "pooled": pooled}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, inpaint=inpaint))
        return states

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._stage(*self.TEXT_ENCODERS)
        """The pipeline's own encoder, one batched call; negative prompts take the same path in diffusers."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        # Rows cloned: a view would keep the whole batch tensor alive in the cache.
        return [(embeds[i : i + 1].clone(), pooled[i : i + 1].clone()) for i in range(len(texts))]

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        cond = self._batched_cond(states)
        latents = torch.cat([s.latents for s in states])  # [B, C, h, w]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device)  # [B]
        rows = cond["embeds"].shape[0] // len(states)  # 2 with CFG: (negative, positive) per request
        batched = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),  # [B * rows, C, h, w]
            "timestep": timestep.repeat_interleave(rows),
            "encoder_hidden_states": cond["embeds"],
            "pooled_projections": cond["pooled"],
        }
        out = self.ranks.rows(rows, batched, {}, states)  # [B, rows, C, h, w]
        if rows == 1:
            return out[:, 0]
        uncond, text = out[:, 0], out[:, 1]
        scale = cond["scale"].to(out.dtype)  # [B], built once per batch membership, not from a list each step
        guided = uncond + scale.view(-1, 1, 1, 1) * (text - uncond)
        return self._skip_layer_guidance_step(states, batched, text, guided, cond["slg_scale"])

    def _skip_layer_guidance_step(self, states, batched, text, guided, slg_scale) -> torch.Tensor:
        """Requests in their skip-layer window this step: one more forward per set of skipped layers over their
        positive rows, and `guided + (text - skipped) * scale`, as the pipeline computes it."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(states):
            p, n = s.params, s.total_steps
            if (
                p.skip_guidance_layers
                and n * p.skip_layer_guidance_start < s.step_index < n * p.skip_layer_guidance_stop
            ):
                groups.setdefault(p.skip_guidance_layers, []).append(i)
        for layers, rows in groups.items():
            index = to_device(rows, guided.device)
            positive = 2 * index + 1  # rows (negative, positive) per request
            with self.loras.plan([states[i] for i in rows]):
                skipped = self._skipped(batched, positive, layers)
            scale = slg_scale[index].to(guided.dtype).view(-1, 1, 1, 1)
            guided[index] = guided[index] + (text[index] - skipped) * scale
        return guided

    def _skipped(self, batched: dict[str, torch.Tensor], positive: torch.Tensor, layers: tuple[int, ...]):
        """The transformer over the `positive` rows of the batch with `layers` skipped: [len(positive), C, h, w]."""
        return self.transformer(
            hidden_states=batched["hidden_states"][positive],
            timestep=batched["timestep"][positive],
            encoder_hidden_states=batched["encoder_hidden_states"][positive],
            pooled_projections=batched["pooled_projections"][positive],
            skip_layers=list(layers),
            return_dict=False,
        )[0]

    def _tp_plan(self) -> dict[str, str]:
        """diffusers 0.42 has none for SD3: each joint block's attention projections (a second, self-only attention in
        SD3.5's dual layers) and feed-forwards; the last block has no context output or context feed-forward."""
        plan = {}
        for i, block in enumerate(self.transformer.transformer_blocks):
            for name in ("attn", "attn2"):
                attn = getattr(block, name, None)
                if attn is None:
                    continue
                for linear in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                    if getattr(attn, linear, None) is not None:
                        plan[f"transformer_blocks.{i}.{name}.{linear}"] = "colwise"
                plan[f"transformer_blocks.{i}.{name}.to_out.0"] = "rowwise"
                if getattr(attn, "to_add_out", None) is not None:
                    plan[f"transformer_blocks.{i}.{name}.to_add_out"] = "rowwise"
            for ff in ("ff", "ff_context"):
                if getattr(block, ff, None) is not None:
                    plan[f"transformer_blocks.{i}.{ff}.net.0.proj"] = "colwise"
                    plan[f"transformer_blocks.{i}.{ff}.net.2"] = "rowwise"
        return plan

    def _after_tp(self, degree: int) -> None:
        from diffusers.models.attention_processor import Attention

        for module in self.transformer.modules():
            if isinstance(module, Attention):  # SD3's processors split heads by `attn.heads`
                module.heads //= degree

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        self.ranks.ulysses = group
        self.transformer.set_attn_processor(UlyssesJointAttnProcessor(group))
        shard_output(self.transformer.pos_embed, group)  # patch tokens [B, S, D] -> this rank's slice
        gather_output(self.transformer.proj_out, group)  # [B, S_local, p*p*C] -> [B, S, p*p*C] before unpatchify


class SD3Requests(RequestRules):
    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance`.
        return (params.guidance_scale or 0.0) > 1


class UlyssesJointAttnProcessor(DispatchJointAttnProcessor):
    """SD3's joint attention (diffusers `JointAttnProcessor2_0`) with image tokens sharded across `g`: the same
    projections as `DispatchJointAttnProcessor`, the attention itself over the whole sequence by all-to-all."""

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, text_len: int) -> torch.Tensor:
        return ulysses_sdpa(
            query, key, value, self.g, replicated=text_len, replicated_first=False, backend=self._attention_backend
        )
