"""FLUX.1 Kontext (`FluxKontextPipeline` checkpoints): instruction editing. The input image is encoded once, when
the request is prepared, into packed latent tokens that follow the noisy latents in every forward (rotary ids with
their first axis set to 1); the transformer's output for them is dropped. Without an image it generates as FLUX.1.

The image is conditioned at the preferred Kontext resolution closest to its aspect ratio (the sizes Kontext was
trained on, all about 1024x1024), as diffusers' `_auto_resize`, whatever the output's size: the pipeline's image. A
request may send `edit_context: "output"` to scale that resolution to the output's area instead: a 512x512 edit then
attends to 1,024 context tokens instead of 4,096 (cheaper, and not the pipeline's image).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from diffusiond.models.families import specs
from diffusiond.models.families.flux import FluxAdapter, FluxRequests
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.inputs import image_size, open_rgb
from diffusiond.models.params import ParamError, SamplingParams


class FluxKontextAdapter(FluxAdapter):
    spec = specs.FLUX_KONTEXT

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return KontextRequests(caps, declared, **parts)

    def _initial_latents(self, p: SamplingParams, sampler, generator, channels: int, dtype: torch.dtype):
        size = self.requests.context_size(p)
        image = None
        if size is not None:
            self._stage("vae")
            width, height = size
            # As the pipeline: resize with its image processor, then normalise at that size.
            resized = self.pipe.image_processor.resize(open_rgb(p.image), height, width)
            image = self.pipe.image_processor.preprocess(resized, height, width)
        # The pipeline's own: the image's latent mode (no draw), then the noise from the request's generator.
        latents, context, latent_ids, context_ids = self.pipe.prepare_latents(
            image, 1, channels, p.height, p.width, dtype, self.device, generator
        )
        if context_ids is None:
            return latents, latent_ids, None, None
        return latents, torch.cat([latent_ids, context_ids]), context, None


class KontextRequests(FluxRequests):
    # The area PREFERRED_KONTEXT_RESOLUTIONS are made for.
    preferred_area: ClassVar[int] = 1024 * 1024

    def context_size(self, params: SamplingParams) -> tuple[int, int] | None:
        """(width, height) the request's input image is conditioned at (resolved `params`); None without one."""
        if params.image is None:
            return None
        image_width, image_height = image_size(params.image)
        ratio = image_width / image_height
        _, width, height = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        scale = 1.0
        if params.edit_context == "output":
            scale = math.sqrt(params.width * params.height / self.preferred_area)
        m = self.caps.size_multiple
        return max(m, int(width * scale) // m * m), max(m, int(height * scale) // m * m)

    def _edit_context(self, params: SamplingParams) -> str | None:
        if params.image is None:
            if params.edit_context is not None:
                raise ParamError("edit_context", "edit_context sizes an input image; this request sends none")
            return None
        return params.edit_context or "preferred"
