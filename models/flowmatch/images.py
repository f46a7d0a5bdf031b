"""An input image's first latents: img2img and inpainting as the Img2Img and Inpaint pipelines start them. A family's
adapter holds one (`FlowMatchAdapter.images`), made with its pipeline's image processor, its VAE encoder (the
family's latent normalisation) and how its scheduler noises an image to a request's first step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.models.inputs import open_mask, open_rgb
from diffusiond.models.params import SamplingParams

# Preprocessed images [B, 3, H, W] in [-1, 1], the request's generator -> model-space latents [B, C, h, w].
Encode = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
# The request, its sampler, the image's latents, the noise -> its first latents.
Start = Callable[[SamplingParams, Any, torch.Tensor, torch.Tensor], torch.Tensor]


class Inpaint:
    """One inpainting request's image latents, the noise it started from and its latent mask (1: repainted), in
    the family's latent layout."""

    __slots__ = ("image", "mask", "noise")

    def __init__(self, image: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> None:
        self.image, self.noise, self.mask = image, noise, mask

    def map(self, fn) -> Inpaint:
        """The same with each tensor mapped (a family's packing)."""
        return Inpaint(fn(self.image), fn(self.noise), fn(self.mask))

    def blend(self, latents: torch.Tensor, sampler: Any) -> torch.Tensor:
        """After a step, as the Inpaint pipelines: outside the mask, the image noised to the step the sampler
        reached (`renoise`; after the last step, the image itself)."""
        proper = sampler.renoise(self.image, self.noise)
        return (1 - self.mask) * proper + self.mask * latents


def noise_image(p: SamplingParams, sampler: Any, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The image's latents noised to the request's first step (the scheduler's own noising)."""
    return sampler.noise_image(image_latents, noise)


class ImageStart:
    """`processor`: the pipeline's image processor; `encode`: the family's VAE encoding; `start`: its noising;
    `stage(*names)`: brings components to the device (offloading); `size_multiple`: the mask's resize multiple."""

    def __init__(
        self,
        processor: Any,
        encode: Encode,
        *,
        stage: Callable[..., None],
        size_multiple: int,
        start: Start = noise_image,
    ) -> None:
        self.processor, self.encode, self.start, self.stage = processor, encode, start, stage
        self.size_multiple = size_multiple

    def noised(
        self, p: SamplingParams, sampler: Any, generator: torch.Generator, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, Inpaint | None]:
        """Img2img's first latents, VAE-shaped [1, C, h, w], as the Img2Img and Inpaint pipelines' `prepare_latents`
        make them: the image resized by the pipeline's image processor, its latent distribution sampled with the
        request's generator, then the noise drawn from the same generator and mixed in at the starting sigma. With a
        mask, also what pins the unmasked region (VAE-shaped too; the family maps it to its layout)."""
        self.stage("vae")
        image = self.processor.preprocess(open_rgb(p.image), height=p.height, width=p.width)
        latents = self.encode(image.to(device, dtype), generator)
        noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=dtype)
        noised = self.start(p, sampler, latents, noise)
        if p.mask is None:
            return noised, None
        # The Inpaint pipelines' mask: binarized at the output size, then nearest-resized to the latents'.
        mask = self._mask_processor().preprocess(open_mask(p.mask), height=p.height, width=p.width)
        mask = torch.nn.functional.interpolate(mask, size=latents.shape[-2:], mode="nearest")
        mask = mask.view([1] * (latents.dim() - 2) + list(latents.shape[-2:])).expand_as(latents)
        return noised, Inpaint(latents, noise, mask.to(device, dtype).contiguous())

    def _mask_processor(self) -> Any:
        """The Inpaint pipelines' `mask_processor` (the text-to-image pipeline we load has none)."""
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(
            vae_scale_factor=self.size_multiple, do_normalize=False, do_binarize=True, do_convert_grayscale=True
        )
