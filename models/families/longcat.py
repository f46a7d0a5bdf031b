"""LongCat-Image (`LongCatImagePipeline` checkpoints): Ovis-Image's kind of MMDiT over FLUX.1's packed latents (its own
timestep embedding, no guidance embedding), read by a Qwen2.5-VL text encoder that first rewrites each prompt by
generating text from it (the pipeline's default; a request's `arguments: {"enable_prompt_rewrite": false}` encodes
the prompt as sent). Prompts are padded to one length (512 tokens), so any two requests of one size and CFG share a
forward. CFG whenever `guidance_scale` > 1 (default 4.5, 50 steps, 1024x1024, as its pipeline), renormalized to the
positive prediction's norm unless a request's `enable_cfg_renorm` is false (`cfg_renorm_min`, default 0, bounds the
rescale from below), per request inside a batch.

diffusers 0.42.1's call hands out no steps (no step callback), so the generic path cannot serve it: this family does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import LongCatImagePipeline
from diffusers.pipelines.longcat_image.pipeline_longcat_image_edit import calculate_dimensions, prepare_pos_ids

from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.families.ovis import OvisImageAdapter, OvisRequests
from diffusiond.models.flowmatch.prompts import Prompts, PromptsWithImages
from diffusiond.models.flowmatch.requests import RequestRules, output_sized_context
from diffusiond.models.flowmatch.sampler import request_generator, shift_mu
from diffusiond.models.inputs import image_size, open_rgb
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache

# The prompt cache's key of a prompt to be rewritten before it is encoded (its text after the marker).
REWRITE = "\x00rewrite\x00"


class LongCatImageAdapter(OvisImageAdapter):
    spec = specs.LONGCAT_IMAGE
    # The pipeline's own defaults.
    default_steps = 50
    default_guidance = 4.5

    def _step_cache(self) -> StepCache:
        cached = partial(forwards.longcat_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return LongCatRequests(caps, declared, **parts)

    def _tp_plan(self) -> dict[str, Any]:
        """FLUX.1's plan (diffusers ships it; the blocks' linears are named alike): its single blocks' output
        projection reads the attention's and the MLP's columns concatenated, each sharded on its own, in the
        proportion of their widths (FLUX.1 stores them on the linear at init; LongCat-Image's does not)."""
        from diffusers import FluxTransformer2DModel
        from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

        plan = dict(FluxTransformer2DModel._tp_plan)
        single = self.transformer.single_transformer_blocks
        if len(single):
            widths = [single[0].proj_out.in_features - single[0].mlp_hidden_dim, single[0].mlp_hidden_dim]
            plan["single_transformer_blocks.*.proj_out"] = PackedRowwiseParallel(blocks=widths)
        return plan

    def _after_tp(self, degree: int) -> None:
        from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttention

        for module in self.transformer.modules():
            if isinstance(module, LongCatImageAttention):  # its processor splits heads by `attn.heads`
                module.heads //= degree

    def _prompts(self) -> Prompts:
        return RewrittenPrompts(self._encode, self.requests.uses_cfg)

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return LongCatImagePipeline._unpack_latents(latents, params.height, params.width, self.vae_scale_factor)

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """Each prompt to be rewritten is rewritten alone (as the pipeline's call for one request does: the text
        encoder generates its new prompt), then every text is encoded in one call, padded to the pipeline's length."""
        self._stage(*self.TEXT_ENCODERS)
        plain = [
            self.pipe.rewire_prompt([t.removeprefix(REWRITE)], self.device)[0] if t.startswith(REWRITE) else t
            for t in texts
        ]
        embeds, _ = self.pipe.encode_prompt(prompt=plain)
        # Rows cloned: a view would keep the whole batch tensor alive in the prompt cache.
        return [(embeds[i : i + 1].clone(),) for i in range(len(texts))]

    def _guidance(self, params: SamplingParams) -> dict[str, torch.Tensor]:
        arguments = params.arguments or {}
        on = bool(arguments.get("enable_cfg_renorm", True))
        floor = float(arguments.get("cfg_renorm_min", 0.0))
        return {
            "renorm": torch.full([1], float(on), device=self.device),
            "renorm_min": torch.full([1], floor, device=self.device),
        }

    def _guide(self, pos: torch.Tensor, neg: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """CFG, then (each request as it asks) rescaled to the positive prediction's norm per token, the rescale
        clamped to [cfg_renorm_min, 1], as the pipeline's `enable_cfg_renorm`."""
        guided = super()._guide(pos, neg, cond)
        ratio = torch.norm(pos, dim=-1, keepdim=True) / (torch.norm(guided, dim=-1, keepdim=True) + 1e-8)
        floor = cond["renorm_min"].to(ratio.dtype).view(-1, 1, 1)
        scale = torch.minimum(torch.maximum(ratio, floor), torch.ones_like(ratio))
        return torch.where(cond["renorm"].view(-1, 1, 1) > 0, guided * scale, guided)

    def _text_ids(self, embeds: torch.Tensor) -> torch.Tensor:
        """(0, i, i) for token i, in float32 whatever the text's dtype (the pipeline's `prepare_pos_ids`)."""
        return super()._text_ids(embeds.float())


class LongCatRequests(OvisRequests):
    # The call's own switches, by its names, at its defaults.
    call_arguments: ClassVar[dict[str, tuple[type, Any, tuple[float, float] | None]]] = {
        "enable_prompt_rewrite": (bool, True, None),
        "enable_cfg_renorm": (bool, True, None),
        "cfg_renorm_min": (float, 0.0, (0.0, 1.0)),
    }


class RewrittenPrompts(Prompts):
    """Prompts a request has rewritten (the default) are kept under a key of their own: the same text sent as a
    negative prompt, or with the rewrite off, is encoded as written."""

    def key(self, text: str, params: SamplingParams) -> str:
        rewrite = (params.arguments or {}).get("enable_prompt_rewrite", True)
        return REWRITE + text if rewrite else text

    def negative_key(self, text: str, params: SamplingParams) -> str:
        return text  # never rewritten


class LongCatImageEditAdapter(LongCatImageAdapter):
    """LongCat-Image-Edit (`LongCatImageEditPipeline` checkpoints): instruction edits of one image. The image enters
    twice, as the pipeline does: the Qwen2.5-VL text encoder reads it (at half the output's sides) before the
    instruction, and its VAE latent (at the output's size, latent mode: no draw) follows the noisy latents in every
    step, its rotary ids on modality axis 2; the transformer's output for those tokens is dropped. No prompt rewrite,
    no renormalization: plain CFG whenever `guidance_scale` > 1. The output's size defaults to the image's aspect at
    1024x1024's area (the pipeline's: it takes no size); a request's `width` and `height` stand in for that size
    everywhere the pipeline reads it (the encoder's image, the VAE's)."""

    spec = specs.LONGCAT_IMAGE_EDIT

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return LongCatEditRequests(caps, declared, **parts)

    def _prompts(self) -> Prompts:
        # An instruction's encoding reads the image at the output's size: keyed by the image's digest, that size and
        # the text.
        return PromptsWithImages(self._encode, self.requests.uses_cfg, _context, lambda p: (p.image, p.width, p.height))

    def _resized(self, data: bytes, width: int, height: int) -> Any:
        return self.pipe.image_processor.resize(open_rgb(data), height, width)

    def _encode(self, keys: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder, one prompt at a time beside its image (the pipeline encodes one prompt per
        call), resized twice as the pipeline's call does: to the output's size, then to half its sides."""
        self._stage(*self.TEXT_ENCODERS)
        out = []
        for key in keys:
            context, _, text = key.partition("\x00")
            data, width, height = self.prompts.pending[context]
            image = self.pipe.image_processor.resize(self._resized(data, width, height), height // 2, width // 2)
            embeds, _ = self.pipe.encode_prompt(prompt=[text], image=image)
            out.append((embeds.clone(),))  # [1, L, D]: the image's tokens, then the padded text
        return out

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # key -> ([1, L, D],)
        channels = self.transformer.config.in_channels // 4
        states = []
        for i, (request_id, p) in enumerate(requests):
            (embeds,) = text[self.prompts.key(p.prompt, p)]
            self._stage("vae")
            image = self.pipe.image_processor.preprocess(self._resized(p.image, p.width, p.height), p.height, p.width)
            generator = request_generator(p)
            latents, context, ids = self._latents(image, channels, p, embeds, generator)
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            sampler = self._sampler(
                p, generator, sigmas=sigmas, mu=shift_mu(self.pipe.scheduler.config, latents.shape[1])
            )
            cond: dict[str, Any] = {"embeds": embeds, "context": context}
            if cfg[i]:
                # Rows (positive, negative) per request; a batch interleaves them.
                (negative,) = text[self.prompts.negative_key(p.negative_prompt or "", p)]
                cond["embeds"] = torch.cat([embeds, negative])
                cond["scale"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            shared = {"text_ids": self._text_ids(embeds), "image_ids": ids}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, shared=shared))
        return states

    def _latents(
        self, image: torch.Tensor, channels: int, p: SamplingParams, embeds: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the noise [1, seq, C * 4], the image's packed latent mode [1, ctx, C * 4], the rotary ids of both
        [seq + ctx, 3]), as the pipeline's `prepare_latents` makes them, its own parts called here: it moves the image
        to the pipeline's `device`, its first module's, the text encoder's, which a rank that does not encode keeps
        on "meta" (`enable_encode_once`). The latent mode draws nothing: the noise is the generator's first draw."""
        pipe, length = self.pipe, embeds.shape[1]
        latents, _, latent_ids, _ = pipe.prepare_latents(
            None, 1, channels, p.height, p.width, embeds.dtype, length, self.device, generator
        )
        mode = pipe._encode_vae_image(image.to(self.device, embeds.dtype), generator)  # [1, C, h, w]
        context = pipe._pack_latents(mode, 1, channels, mode.shape[2], mode.shape[3])
        context_ids = prepare_pos_ids(
            modality_id=2, type="image", start=(length, length), height=mode.shape[2] // 2, width=mode.shape[3] // 2
        ).to(self.device, dtype=torch.float64)
        return latents, context, torch.cat([latent_ids, context_ids])

    def _guide(self, pos: torch.Tensor, neg: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        return OvisImageAdapter._guide(self, pos, neg, cond)  # plain CFG: the edit pipeline does not renormalize


class LongCatEditRequests(OvisRequests):
    def _strength(self, params: SamplingParams) -> float | None:
        if params.image is None:
            raise ParamError("image", f"the {self.family} family edits images: send the image to edit (image)")
        return super()._strength(params)

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """Unsent sides: the image's aspect at 1024x1024's area, as the pipeline's call sizes its output."""
        if params.width is not None or params.height is not None or params.image is None:
            return super()._size(params)
        width, height = image_size(params.image)
        return calculate_dimensions(1024 * 1024, width / height)

    def context_size(self, params: SamplingParams) -> tuple[int | None, int | None] | None:
        return output_sized_context(params)  # the image is read and encoded at the output's size


def _context(params: SamplingParams) -> str:
    return f"{hashlib.sha256(params.image).hexdigest()[:32]}:{params.width}x{params.height}"
