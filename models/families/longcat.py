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

from functools import partial
from typing import Any, ClassVar

import torch
from diffusers import LongCatImagePipeline

from diffusiond.models.families import specs
from diffusiond.models.families.ovis import OvisImageAdapter, OvisRequests
from diffusiond.models.flowmatch.prompts import Prompts
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.params import SamplingParams
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
