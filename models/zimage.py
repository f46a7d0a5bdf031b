"""Z-Image (`ZImagePipeline` checkpoints): a single-stream DiT that takes its latents and caption features as lists,
so prompts of any length share a forward without padding on our side. Its classifier-free guidance is on whenever
`guidance_scale` > 0 and reads `pos + scale * (pos - neg)`; the transformer predicts the negated velocity.

The distilled Turbo checkpoints run at `guidance_scale` 0 (one row per request) and 8-9 steps: a checkpoint says so in
`diffusiond.json` (models/declared.py), since `model_index.json` cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from diffusiond.engine.request import SamplingParams
from diffusiond.engine.wire import NewRequest
from diffusiond.models.base import RequestState
from diffusiond.models.flowmatch import FlowMatchAdapter


class ZImageAdapter(FlowMatchAdapter):
    pipeline_class = "ZImagePipeline"
    family = "z-image"
    vae_family = "flux"  # Z-Image decodes with FLUX.1's VAE
    # The pipeline's own defaults.
    default_steps = 50
    default_guidance = 5.0
    guidance_styles = ("cfg",)
    image_inputs = ("img2img", "mask")
    default_inpaint_strength = 1.0  # ZImageInpaintPipeline's
    max_sequence_length = 512
    TEXT_ENCODERS = ("text_encoder",)

    def _default_size(self) -> tuple[int, int]:
        return 1024, 1024

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def _uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance` (the truncation it may apply is off by default).
        return (params.guidance_scale or 0.0) > 0

    @torch.inference_mode()
    def prepare(self, new: Sequence[NewRequest]) -> list[RequestState]:
        params = [n.params for n in new]
        cfg, text = self._lookup_prompts(params)  # text -> ([L, D],)
        states = []
        for i, (req, p) in enumerate(zip(new, params, strict=True)):
            h, w = self._packed_latent_size(p)
            sigmas = get_default_z_image_sigmas(p.num_inference_steps)
            sampler = self._sampler(p, sigmas=sigmas, mu=self._shift_mu((h // 2) * (w // 2)))
            generator = self._generator(p)
            inpaint = None
            if p.image is None:
                # float32 whatever the transformer's dtype, as the pipeline keeps them.
                latents = self.pipe.prepare_latents(
                    1, self.transformer.in_channels, p.height, p.width, torch.float32, self.device, generator
                )  # [1, C, h, w]
            else:
                # The text features' dtype, as ZImageImg2ImgPipeline draws them.
                latents, inpaint = self._noised_image(p, sampler, generator, text[p.prompt][0].dtype)
            # Rows (positive, negative) per request; a batch interleaves them.
            rows = [text[p.prompt][0]]
            cond = {}
            if cfg[i]:
                rows.append(text[p.negative_prompt or ""][0])
                cond["scale"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            states.append(RequestState(req.request_id, p, latents, sampler, cond=cond, rows=rows, inpaint=inpaint))
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
        out = self._transformer_rows(rows, batched, {}, states).float().squeeze(3)  # [B, rows, C, h, w]
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
