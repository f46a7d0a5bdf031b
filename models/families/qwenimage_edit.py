"""Qwen-Image-Edit-2509/2511 (`QwenImageEditPlusPipeline` checkpoints): instruction edits of one to three images;
and the first Qwen-Image-Edit (`QwenImageEditPipeline`: one image, read and encoded at 1024x1024's area).

Each image of a request (`image`, then `reference_images`) enters twice, as the pipeline does: the Qwen2.5-VL text
encoder reads it beside the instruction (resized to 384x384's area, "Picture 1: ..."), and its VAE latent (at
1024x1024's area, latent mode: no draw) joins every step's sequence after the noisy latents; the transformer's output
for those tokens is dropped. A 2511 checkpoint (`zero_cond_t`) modulates the image tokens at timestep 0. The output's
size defaults to the last image's aspect at 1024x1024's area, as the pipeline's.

A prompt's encoding depends on its images, so the prompt cache keys it by text and images (`_prompt_key`). Requests
share forwards when their output size, CFG and every image's latent size agree (the rotary positions are the
batch's); their texts are padded and masked as Qwen-Image's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as calculate_dimensions_edit
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)

from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.families.qwenimage import QwenImageAdapter, QwenImageRequests
from diffusiond.models.flowmatch.prompts import Prompts, PromptsWithImages
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import request_generator, shift_mu
from diffusiond.models.inputs import image_size, open_rgb
from diffusiond.models.params import ParamError, SamplingParams


class QwenImageEditPlusAdapter(QwenImageAdapter):
    spec = specs.QWEN_IMAGE_EDIT_PLUS

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return QwenEditRequests(caps, declared, **parts)

    def _prompts(self) -> Prompts:
        return images_prompts(self._encode, self.requests.uses_cfg)

    # ---- prompts: each keyed by its text and its images (`PromptsWithImages`) ----

    def _prompt_images(self, images: list[Any]) -> Any:
        """What the pipeline's `encode_prompt` takes: the list ("Picture 1: ... Picture 2: ...")."""
        return images

    def _latent_images(self, images: list[torch.Tensor]) -> Any:
        """What the pipeline's `prepare_latents` takes: the list."""
        return images

    def _condition_image(self, data: bytes) -> Any:
        image = open_rgb(data)
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        return self.pipe.image_processor.resize(image, height, width)

    def _encode(self, keys: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's own encoder, one prompt at a time with its images (the pipeline encodes one request's
        prompt per call): each prompt's embeddings without padding [L, D]."""
        self._stage(*self.TEXT_ENCODERS)
        out = []
        for key in keys:
            digest, _, text = key.partition("\x00")
            images = [self._condition_image(data) for data in self.prompts.pending[digest]]
            embeds, mask = self.pipe.encode_prompt(image=self._prompt_images(images), prompt=[text], device=self.device)
            length = int(mask.sum()) if mask is not None else embeds.shape[1]
            out.append((embeds[0, :length].clone(),))
        return out

    # ---- prepare and denoise ----

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # key -> ([L, D],)
        channels = self.transformer.config.in_channels // 4
        s = self.vae_scale_factor
        states = []
        for i, (request_id, p) in enumerate(requests):
            embeds = text[self.prompts.key(p.prompt, p)][0]
            sizes = self.requests.context_size(p)
            assert sizes is not None
            self._stage("vae")
            vae_images = [
                self.pipe.image_processor.preprocess(open_rgb(data), height, width).unsqueeze(2)
                for data, (width, height) in zip((p.image, *(p.reference_images or ())), sizes, strict=True)
            ]
            generator = request_generator(p)
            # The pipeline's own: the images' latent modes (no draw), then the noise from the request's generator.
            latents, context = self.pipe.prepare_latents(
                self._latent_images(vae_images), 1, channels, p.height, p.width, embeds.dtype, self.device, generator
            )  # [1, seq, C * 4], [1, ctx, C * 4]
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            sampler = self._sampler(
                p, generator, sigmas=sigmas, mu=shift_mu(self.pipe.scheduler.config, latents.shape[1])
            )
            rows = [embeds]
            cond = {
                "guidance": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32),
                "context": context,
            }
            if cfg[i]:
                rows.append(text[self.prompts.key(p.negative_prompt or "", p)][0])
                cond["guidance"] = cond["guidance"].expand(2)
                cond["true_cfg"] = torch.full([1], p.true_cfg_scale, device=self.device, dtype=torch.float32)
            shapes = [(1, p.height // s // 2, p.width // s // 2), *((1, h // s // 2, w // s // 2) for w, h in sizes)]
            shared = {"img_shapes": [shapes]}  # the transformer reads the first entry only: one per batch key
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, shared=shared))
        return states


def images_prompts(encode: Any, uses_cfg: Any) -> PromptsWithImages:
    """Prompts keyed by their text and the request's images (`image`, then `reference_images`), in order."""
    return PromptsWithImages(encode, uses_cfg, _digest, lambda p: [p.image, *(p.reference_images or ())])


def _digest(params: SamplingParams) -> str:
    """Of a request's images, in order."""
    images = (params.image, *(params.reference_images or ()))
    return hashlib.sha256(b"".join(hashlib.sha256(d).digest() for d in images)).hexdigest()[:32]


def _ratio(data: bytes, param: str) -> float:
    width, height = image_size(data, param)
    return width / height


def _ratios(params: SamplingParams) -> list[float]:
    files = [("image", params.image)] + [("reference_images", d) for d in params.reference_images or ()]
    return [_ratio(data, param) for param, data in files]


class QwenImageEditAdapter(QwenImageEditPlusAdapter):
    """Qwen-Image-Edit (`QwenImageEditPipeline`, the first release): one image, read by the text encoder and encoded
    by the VAE at the same size, its aspect at 1024x1024's area."""

    spec = specs.QWEN_IMAGE_EDIT

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return QwenEditOneRequests(caps, declared, **parts)

    def _condition_image(self, data: bytes) -> Any:
        image = open_rgb(data)
        width, height, _ = calculate_dimensions_edit(VAE_IMAGE_SIZE, image.width / image.height)
        return self.pipe.image_processor.resize(image, height, width)

    def _prompt_images(self, images: list[Any]) -> Any:
        (image,) = images
        return image

    def _latent_images(self, images: list[torch.Tensor]) -> Any:
        (image,) = images
        return image


class QwenEditRequests(QwenImageRequests):
    # The pipeline's: up to three images, the first edited and the others its references.
    max_references: ClassVar[int] = 2

    def _strength(self, params: SamplingParams) -> float | None:
        if params.image is None:
            raise ParamError("image", f"the {self.family} family edits images: send the image to edit (image)")
        if params.strength is not None:
            raise ParamError("strength", f"the {self.family} family edits by instruction; strength does not apply")
        self.context_size(params)  # files that are not images are refused here, naming them
        return None

    def _references(self, params: SamplingParams) -> tuple[bytes, ...] | None:
        references = super()._references(params)
        if references is not None and len(references) > self.max_references:
            raise ParamError(
                "reference_images",
                f"the {self.family} family edits with at most {self.max_references} reference images, "
                f"got {len(references)}",
            )
        return references

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """Unsent sides: the last image's aspect at 1024x1024's area, as the pipeline's default."""
        if params.width is not None or params.height is not None or params.image is None:
            return super()._size(params)
        last = (params.reference_images or (params.image,))[-1]
        width, height = calculate_dimensions(1024 * 1024, _ratio(last, "image"))
        m = self.caps.size_multiple
        return width // m * m, height // m * m

    def context_size(self, params: SamplingParams) -> tuple[tuple[int, int], ...] | None:
        """(width, height) of each image's latent input, as the pipeline sizes them (1024x1024's area)."""
        if params.image is None:
            return None
        return tuple(calculate_dimensions(VAE_IMAGE_SIZE, ratio) for ratio in _ratios(params))


class QwenEditOneRequests(QwenEditRequests):
    """The first Qwen-Image-Edit: one image, read and encoded at the same size."""

    def context_size(self, params: SamplingParams) -> tuple[tuple[int, int], ...] | None:
        if params.image is None:
            return None
        width, height, _ = calculate_dimensions_edit(VAE_IMAGE_SIZE, _ratio(params.image, "image"))
        return ((width, height),)
