"""The demo model's fast preview map (`diffusiond_preview.json`): fitted against its own VAE on rendered scenes, and
how far its colours are from the image's. Used by `train.py` when it saves a checkpoint, and by
`python -m diffusiond.tools.demo.train --out DIR --refit-preview`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusiond.tools.demo import scenes as sc
from diffusiond.tools.demo.train import image_batch


@torch.no_grad()
def scene_latents(vae: Any, scenes: list[sc.Scene], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(model-space latents [n, C, h, w], their pooled decodes [n, 3, h, w]) of n rendered scenes."""
    from diffusiond.models.preview import decode_pooled

    x = image_batch(np.random.default_rng(seed), scenes, n)
    z = torch.cat([vae.encode(x[i : i + 128]).latent_dist.mean for i in range(0, n, 128)])
    z = (z - vae.config.shift_factor) * vae.config.scaling_factor
    rgb = torch.cat([decode_pooled(vae, z[i : i + 128]) for i in range(0, n, 128)])
    return z, rgb


@torch.no_grad()
def fit_preview(vae: Any, scenes: list[sc.Scene], n: int = 512, seed: int = 11) -> Any:
    """Least-squares latent -> RGB map against real data: model-space latents of rendered scenes and their pooled
    decodes (`preview.decode_pooled`), so previews of a finished image look like the image. Each pixel's latent and
    the image's mean latent are the inputs (`LatentRGB.context`): this VAE's GroupNorm has one group, so a colour's
    latent depends on the rest of the image, and a per-pixel map alone left colours off by 19/255 in scenes (white
    pink, green olive); with the mean, 6.5 (`colour_error`)."""
    from diffusiond.models.preview import LatentRGB

    z, rgb = scene_latents(vae, scenes, n, seed)
    count, channels, h, w = z.shape
    pixels = z.permute(0, 2, 3, 1).reshape(-1, channels)
    means = z.mean(dim=(2, 3))[:, None, None, :].expand(count, h, w, channels).reshape(-1, channels)
    a = torch.cat([pixels, means, torch.ones(len(pixels), 1)], dim=1).double()
    y = rgb.permute(0, 2, 3, 1).reshape(-1, 3).double()
    sol = torch.linalg.lstsq(a, y, driver="gelsd").solution  # [2C + 1, 3]

    def rows(t: torch.Tensor) -> list[list[float]]:
        return [[round(float(v), 6) for v in row] for row in t.tolist()]

    return LatentRGB(
        factors=rows(sol[:channels]),
        context=rows(sol[channels : 2 * channels]),
        bias=[round(float(v), 6) for v in sol[-1].tolist()],
        source="fitted:demo-scenes+context",
    )


@torch.no_grad()
def colour_error(vae: Any, rgb_map: Any, scenes: list[sc.Scene], n: int = 64, seed: int = 5) -> dict[str, float]:
    """Mean absolute error (of 255) of the preview, per palette colour, over the flat pixels of rendered scenes (latent
    pixels whose decode is within 10/255 of that colour): how far previews are from the colours the image will have."""
    z, rgb = scene_latents(vae, scenes, n, seed)
    palette = torch.tensor(list(sc.COLOURS.values()), dtype=torch.float32) / 127.5 - 1.0
    target = rgb.permute(0, 2, 3, 1).reshape(-1, 3)
    preview = rgb_map.to_float(z).reshape(-1, 3)
    distance = torch.cdist(target, palette)
    nearest, flat = distance.argmin(dim=1), distance.min(dim=1).values < 0.08
    out = {}
    for i, name in enumerate(sc.COLOURS):
        chosen = flat & (nearest == i)
        out[name] = round(float(((preview[chosen] - palette[i]).abs().mean(dim=1) * 127.5).mean()), 1)
    return out


def refit_preview(checkpoint: Path) -> dict[str, dict[str, float]]:
    """Fit the preview map of an existing checkpoint again (the same data and seeds as training); returns the colour
    errors on held-out scenes before and after."""
    import msgspec
    from diffusers import AutoencoderKL

    from diffusiond.models.preview import FACTORS_FILE, load_preview_factors

    vae = AutoencoderKL.from_pretrained(checkpoint / "vae").eval()
    train, held_out = sc.split()
    before = colour_error(vae, load_preview_factors(checkpoint), held_out)
    rgb = fit_preview(vae, train)
    (checkpoint / FACTORS_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(rgb)) + b"\n")
    return {"before": before, "after": colour_error(vae, rgb, held_out)}
