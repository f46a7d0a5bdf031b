"""What a pipeline on the generic path serves, read from it at load: its defaults (size, steps, guidance, frames),
the multiple its sides must be, its modality and sample rate, what a request may add; and the map that turns its
latents into a preview."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from diffusiond.models import preview as preview_maps
from diffusiond.models.base import Capabilities, decodes_alpha
from diffusiond.models.declared import Declared
from diffusiond.models.generic.outputs import sample_rate
from diffusiond.models.generic.signature import CallSpec
from diffusiond.models.params import MAX_FRAMES


def capabilities_of(
    pipe: Any, call: CallSpec, declared: Declared, *, dtype: torch.dtype, device: torch.device
) -> Capabilities:
    d = declared
    width, height = default_size(pipe, call)
    frames = call.default("num_frames")
    caps = Capabilities(
        family="generic",
        pipeline_class=call.pipeline_class,
        default_width=d.width or width,
        default_height=d.height or height,
        default_steps=d.num_inference_steps or int(call.default("num_inference_steps") or 50),
        default_guidance=float(d.guidance_scale if d.guidance_scale is not None else _number(call, "guidance_scale")),
        size_multiple=size_multiple(pipe),
        max_side=4096,
        supports_negative_prompt=call.takes("negative_prompt"),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        sizes=tuple(tuple(s) for s in d.sizes) if d.sizes else None,
        steps=d.steps,
        guidance=d.guidance,
        vocabulary=d.vocabulary,
        draws=d.draws,
        name=d.name,
        image_inputs=call.image_inputs,
        modality=call.modality,
        mode="generic",
        fields=tuple(call.settable()),
        alpha=call.modality == "image" and decodes_alpha(getattr(pipe, "vae", None)),
    )
    if call.modality == "video":
        fps = call.default("frame_rate") or call.default("fps") or 16
        caps = dataclasses.replace(
            caps,
            default_num_frames=int(frames) if isinstance(frames, int) else 1,
            max_num_frames=MAX_FRAMES,
            frame_step=1,
            default_fps=int(fps),
        )
    rate = sample_rate(pipe)
    if rate is not None and call.modality in ("video", "audio"):
        caps = dataclasses.replace(caps, audio_sample_rate=rate)
    return caps


def default_size(pipe: Any, call: CallSpec) -> tuple[int, int]:
    """The call's own default (its signature's, a Modular text-to-image branch's), else its sample size in pixels;
    (0, 0) where it says none (a sound model)."""
    width, height = call.default("width"), call.default("height")
    if isinstance(width, int) and isinstance(height, int):
        return width, height
    if call.size is not None:
        return call.size
    side = getattr(pipe, "default_sample_size", None)
    unet = getattr(pipe, "unet", None)
    if side is None and unet is not None:
        side = getattr(unet.config, "sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    if isinstance(side, int) and isinstance(scale, int):
        return side * scale, side * scale
    return 0, 0


def size_multiple(pipe: Any) -> int:
    """What the sides must be a multiple of: the VAE's downscale times the denoiser's patch, or its packing of 2x2
    latents into one token (FLUX's: a transformer taking 4x the VAE's channels). A side the call would refuse (FLUX.3:
    'divisible by 16') is then a 400 before it is queued."""
    scale = getattr(pipe, "vae_scale_factor", None)
    scale = scale if isinstance(scale, int) and scale > 0 else 8
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    config = getattr(denoiser, "config", None)
    patch = getattr(config, "patch_size", None)
    if isinstance(patch, list | tuple):  # video transformers: (t, h, w)
        patch = patch[-1]
    patch = patch if isinstance(patch, int) and patch > 0 else 1
    vae = getattr(pipe, "vae", None)
    latent = getattr(getattr(vae, "config", None), "latent_channels", None)
    channels = getattr(config, "in_channels", None)
    if isinstance(latent, int) and isinstance(channels, int) and channels == 4 * latent:
        patch = max(patch, 2)
    return scale * patch


def preview_map(pipe: Any, source: str, device: torch.device) -> preview_maps.LatentRGB | None:
    """A map written beside the checkpoint, or published factors for the VAE it recognises, or one fitted against a
    2-D AutoencoderKL now; None for a VAE of another kind."""
    if os.path.isdir(source):
        fitted = preview_maps.load_preview_factors(source)
        if fitted is not None:
            return fitted
    vae = getattr(pipe, "vae", None)
    config = getattr(vae, "config", None)
    channels = getattr(config, "latent_channels", None)
    if not isinstance(channels, int) or not hasattr(config, "scaling_factor") or not hasattr(vae, "decoder"):
        return None
    published = preview_maps.recognised(config)
    if published is not None and len(published.factors) == channels:
        return published
    if any(p.dim() == 5 for p in vae.parameters()):
        return None
    shift = getattr(config, "shift_factor", None) or 0.0

    def decode(z: torch.Tensor) -> torch.Tensor:
        return vae.decode((z / config.scaling_factor + shift).to(vae.dtype), return_dict=False)[0][:, :3]

    scale = getattr(pipe, "vae_scale_factor", 8)
    return preview_maps.fit_decoder(decode, channels, scale, device=device, dtype=vae.dtype)


def _number(call: CallSpec, name: str) -> float:
    value = call.default(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
