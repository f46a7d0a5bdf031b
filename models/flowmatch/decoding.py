"""How many images (or clips) one VAE call decodes: a VAE's activations grow with what it decodes at once, so
finished requests decode in calls bounded in output pixels (every device) and, on the CPU, in the bytes of the
decoder's widest activation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Output pixels (x frames) one VAE call decodes at most: 4 images of 1024 x 1024, 16 of 512 x 512; a larger image or
# clip is decoded alone.
DECODE_PIXELS = 4 << 20
# On the CPU, the bytes of a VAE call's widest full-size activation (images x pixels x channels): under glibc's
# largest arena allocation (kernels/host.py `keep_freed_memory`), so that its buffers are reused, not mapped and
# faulted in again at each call. Measured here (tiny SD3, 256x256: 4 MB an image, 8 finishing together, on a
# thread of their own with freed memory kept): 8 in one call 89-98 ms with 11,000-18,000 faults, 4 a call 67-69 ms
# and none, 2 68-70 ms, 1 89-92 ms.
CPU_DECODE_BYTES = 16 << 20


def decode_within(
    decode: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor, pixels_each: int, vae: Any
) -> torch.Tensor:
    """`decode` of a batch of latents, in calls of at most DECODE_PIXELS output pixels (x frames) each, one image or
    clip at least (8 images of 2048 x 2048 in one call ran a GPU out of memory, which inside a group is a fault of
    the group); on the CPU also within `cpu_decode_calls`."""
    per_call = max(1, DECODE_PIXELS // max(1, pixels_each))
    if latents.device.type == "cpu":
        per_call = min(per_call, cpu_decode_calls(vae, pixels_each))
    if latents.shape[0] <= per_call:
        return decode(latents)
    return torch.cat([decode(latents[i : i + per_call]) for i in range(0, latents.shape[0], per_call)])


def cpu_decode_calls(vae: Any, pixels_each: int) -> int:
    """Images (or clips) a VAE call decodes at most on the CPU: CPU_DECODE_BYTES of its decoder's widest full-size
    activation (the last up block's channels or the ones upsampled into it); one where the VAE's config does not
    say."""
    config = vae.config
    widths = config.get("decoder_block_out_channels") or config.get("block_out_channels")
    if widths:
        widest = max(widths[:2])
    elif config.get("base_dim"):  # Wan's and Qwen-Image's VAEs
        widest = (config.get("decoder_base_dim") or config["base_dim"]) * max(config.get("dim_mult", [1])[:2])
    else:
        return 1
    return max(1, CPU_DECODE_BYTES // (pixels_each * widest * vae.dtype.itemsize))
