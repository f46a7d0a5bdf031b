"""Latent -> RGB preview maps.

A preview is a small RGB image of the predicted clean latent x0, computed without the VAE as a per-pixel affine map
`rgb[h, w, :] = x0[:, h, w] @ W[C, 3] + b`, values in [-1, 1], shown as uint8 via `(v + 1) / 2 * 255` (rounded). x0 is
in model space: the latent as the transformer sees it, i.e. `(vae_latent - shift_factor) * scaling_factor`. The
preview has the latent's resolution (1/8 of the image); nothing is upscaled here.

Maps come from two places. `published(name)` holds the factors ComfyUI publishes for the real SD3 and FLUX VAEs
(`comfy/latent_formats.py`); they describe those real VAEs only. `fit_latent_rgb(vae)` fits a map by least squares
against any VAE's decoder; the tiny checkpoints' maps are fitted this way against their random VAE, since published
factors describe real VAEs only. `write_preview_factors(checkpoint)` stores a fitted map next to a checkpoint as
`diffusiond_preview.json`, and `load_preview_factors(checkpoint)` reads it back.

A random decoder is far from linear: on the tiny checkpoints the fitted per-pixel map cuts the error of a flat
mean-colour image by only ~1% (SD3) to ~4% (FLUX), so their previews are close to a flat tint and exist to exercise the
preview path; real VAEs are much closer to linear, which is what makes the published factors useful.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

FACTORS_FILE = "diffusiond_preview.json"


class LatentRGB(msgspec.Struct, frozen=True):
    """An affine latent -> RGB map: `factors` is C rows x 3 (R, G, B) and `bias` has 3 entries."""

    factors: list[list[float]]
    bias: list[float]
    source: str = "fitted"
    # Optional C x 3 weights of the latent's mean over the image, added to every pixel. A VAE whose GroupNorm
    # normalises over the whole image (our demo model's: one group) encodes the same colour differently in different
    # images; the mean latent tells the map which (demo model: in-scene colour error 19 -> 6.5 of 255).
    context: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if not self.factors or any(len(row) != 3 for row in self.factors) or len(self.bias) != 3:
            raise ValueError("LatentRGB needs C x 3 factors and 3 biases")
        if self.context is not None and (
            len(self.context) != len(self.factors) or any(len(row) != 3 for row in self.context)
        ):
            raise ValueError("LatentRGB context needs C x 3 weights, like factors")

    @property
    def channels(self) -> int:
        return len(self.factors)

    def tensors(
        self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(W [C, 3], b [3]) as tensors."""
        w = torch.tensor(self.factors, dtype=dtype, device=device)
        b = torch.tensor(self.bias, dtype=dtype, device=device)
        return w, b

    def to_float(self, x0: torch.Tensor) -> torch.Tensor:
        """x0 [..., C, h, w] -> RGB [..., h, w, 3] in [-1, 1] (clamped), on x0's device, float32."""
        if x0.shape[-3] != self.channels:
            raise ValueError(f"latent has {x0.shape[-3]} channels, preview map expects {self.channels}")
        w, b = self.tensors(x0.device)
        x0 = x0.float()
        rgb = torch.einsum("...chw,cr->...hwr", x0, w) + b
        if self.context is not None:
            v = torch.tensor(self.context, dtype=torch.float32, device=x0.device)
            rgb = rgb + torch.einsum("...c,cr->...r", x0.mean(dim=(-2, -1)), v)[..., None, None, :]
        return rgb.clamp_(-1.0, 1.0)

    def to_uint8_batch(self, x0: torch.Tensor) -> torch.Tensor:
        """x0 [B, C, h, w] -> uint8 RGB [B, h, w, 3], left on x0's device (move it with `.cpu()` when needed)."""
        return ((self.to_float(x0) + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)

    def to_uint8(self, x0: torch.Tensor) -> np.ndarray:
        """x0 [C, h, w] -> h x w x 3 uint8 numpy array."""
        if x0.dim() != 3:
            raise ValueError(f"to_uint8 takes one latent [C, h, w], got shape {tuple(x0.shape)}")
        return self.to_uint8_batch(x0.detach()[None])[0].cpu().numpy()


# ComfyUI comfy/latent_formats.py (SD3 and Flux latent_rgb_factors / latent_rgb_factors_bias), model-space latents.
_PUBLISHED: dict[str, tuple[list[list[float]], list[float]]] = {
    "sd3": (
        [
            [-0.0922, -0.0175, 0.0749],
            [0.0311, 0.0633, 0.0954],
            [0.1994, 0.0927, 0.0458],
            [0.0856, 0.0339, 0.0902],
            [0.0587, 0.0272, -0.0496],
            [-0.0006, 0.1104, 0.0309],
            [0.0978, 0.0306, 0.0427],
            [-0.0042, 0.1038, 0.1358],
            [-0.0194, 0.0020, 0.0669],
            [-0.0488, 0.0130, -0.0268],
            [0.0922, 0.0988, 0.0951],
            [-0.0278, 0.0524, -0.0542],
            [0.0332, 0.0456, 0.0895],
            [-0.0069, -0.0030, -0.0810],
            [-0.0596, -0.0465, -0.0293],
            [-0.1448, -0.1463, -0.1189],
        ],
        [0.2394, 0.2135, 0.1925],
    ),
    "flux": (
        [
            [-0.0346, 0.0244, 0.0681],
            [0.0034, 0.0210, 0.0687],
            [0.0275, -0.0668, -0.0433],
            [-0.0174, 0.0160, 0.0617],
            [0.0859, 0.0721, 0.0329],
            [0.0004, 0.0383, 0.0115],
            [0.0405, 0.0861, 0.0915],
            [-0.0236, -0.0185, -0.0259],
            [-0.0245, 0.0250, 0.1180],
            [0.1008, 0.0755, -0.0421],
            [-0.0515, 0.0201, 0.0011],
            [0.0428, -0.0012, -0.0036],
            [0.0817, 0.0765, 0.0749],
            [-0.1264, -0.0522, -0.1103],
            [-0.0280, -0.0881, -0.0499],
            [-0.1262, -0.0982, -0.0778],
        ],
        [-0.0329, -0.0718, -0.0851],
    ),
}


# ComfyUI comfy/latent_formats.py (SD15, SDXL): 4-channel VAEs, model-space latents. Named for the VAE, not a
# family: the generic path recognises these VAEs (`recognised`); the sdxl family keeps its fitted map.
_PUBLISHED["sd1-vae"] = (
    [[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721], [-0.2120, -0.2616, -0.7177]],
    [0.0, 0.0, 0.0],
)
_PUBLISHED["sdxl-vae"] = (
    [[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]],
    [0.1084, -0.0175, -0.0011],
)
# Which published map a VAE's config names: its latent channels, scaling and shift factors.
_RECOGNISED = {(4, 0.18215, None): "sd1-vae", (4, 0.13025, None): "sdxl-vae", (16, 1.5305, 0.0609): "sd3",
               (16, 0.3611, 0.1159): "flux"}  # fmt: skip


def recognised(config: Any) -> LatentRGB | None:
    """The published map of the VAE a config describes (SD 1.x, SDXL, SD3, FLUX.1), None for any other."""
    channels = getattr(config, "latent_channels", None)
    scale, shift = getattr(config, "scaling_factor", None), getattr(config, "shift_factor", None)
    name = _RECOGNISED.get((channels, scale, shift if shift else None))
    return published(name) if name is not None else None


def published(name: str) -> LatentRGB | None:
    """The published map for a real VAE ("sd3", "flux", "sd1-vae", "sdxl-vae"), or None for any other name."""
    entry = _PUBLISHED.get(name)
    if entry is None:
        return None
    factors, bias = entry
    return LatentRGB(factors=[list(r) for r in factors], bias=list(bias), source=f"published:{name}")


def vae_scale_factor(vae: AutoencoderKL) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def decode_pooled(vae: AutoencoderKL, z: torch.Tensor) -> torch.Tensor:
    """Decode model-space latents z [N, C, h, w] with `vae` and average-pool the image, clamped to [-1, 1] as the
    pipelines do before saving, back to the latent resolution: [N, 3, h, w] float32 on the CPU."""
    scaling = vae.config.scaling_factor
    shift = vae.config.shift_factor or 0.0
    param = next(vae.parameters())

    def decode(z: torch.Tensor) -> torch.Tensor:
        return vae.decode((z / scaling + shift).to(device=param.device, dtype=param.dtype)).sample

    return pooled(decode, z, vae_scale_factor(vae))


@torch.no_grad()
def pooled(decode: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, scale: int) -> torch.Tensor:
    """`decode(z)` ([N, 3, h * scale, w * scale] in [-1, 1]) clamped and average-pooled back to the latent
    resolution: [N, 3, h, w] float32 on the CPU."""
    image = decode(z).float().clamp(-1.0, 1.0)
    return torch.nn.functional.avg_pool2d(image, kernel_size=scale, stride=scale).cpu()


def random_latents(channels: int, *, samples: int, size: int, seed: int) -> torch.Tensor:
    """Standard-normal model-space latents [samples, channels, size, size], deterministic for `seed` (CPU RNG)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(samples, channels, size, size, generator=gen)


def fit_latent_rgb(vae: AutoencoderKL, *, samples: int = 8, size: int = 16, seed: int = 0) -> LatentRGB:
    """Least-squares fit of `[x0, 1] @ [W; b] = rgb` over all latent pixels of `samples` random model-space latents
    (size x size, so the VAE only decodes size*8 px images) against their pooled decodes. Deterministic per seed."""
    z = random_latents(vae.config.latent_channels, samples=samples, size=size, seed=seed)
    return fit_pairs(z, decode_pooled(vae, z))


def fit_decoder(
    decode: Callable[[torch.Tensor], torch.Tensor],
    channels: int,
    scale: int,
    *,
    samples: int = 8,
    size: int = 16,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LatentRGB:
    """`fit_latent_rgb` for any decoder of model-space latents [N, C, h, w] (a family's own `_decode`), fed on the
    decoder's `device` and `dtype` (the latents are drawn on the CPU, so the map is the same wherever it is fit)."""
    z = random_latents(channels, samples=samples, size=size, seed=0)
    return fit_pairs(z, pooled(decode, z.to(device=device, dtype=dtype), scale))


def fit_pairs(z: torch.Tensor, rgb: torch.Tensor) -> LatentRGB:
    """The least-squares map from latents z [N, C, h, w] to pooled images rgb [N, 3, h, w]."""
    x = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]).double()
    y = rgb.permute(0, 2, 3, 1).reshape(-1, 3).double()
    a = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    sol = torch.linalg.lstsq(a, y, driver="gelsd").solution  # [C + 1, 3]
    factors = [[round(float(v), 6) for v in row] for row in sol[:-1].tolist()]
    bias = [round(float(v), 6) for v in sol[-1].tolist()]
    return LatentRGB(factors=factors, bias=bias, source="fitted")


def write_preview_factors(checkpoint_dir: str | Path, **fit_kwargs: Any) -> LatentRGB:
    """Fit a preview map against the checkpoint's VAE, through its family's own decode (models/flowmatch/adapter.py),
    and store it as `<dir>/diffusiond_preview.json`."""
    from diffusiond.models.loading.loader import load_adapter

    checkpoint_dir = Path(checkpoint_dir)
    adapter = load_adapter(str(checkpoint_dir))
    rgb = fit_decoder(adapter._decode_rgb, adapter._latent_channels(), adapter.vae_scale_factor, **fit_kwargs)
    (checkpoint_dir / FACTORS_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(rgb)) + b"\n")
    return rgb


def load_preview_factors(checkpoint_dir: str | Path) -> LatentRGB | None:
    """The map stored in `<dir>/diffusiond_preview.json`, or None when the checkpoint has none."""
    path = Path(checkpoint_dir) / FACTORS_FILE
    if not path.is_file():
        return None
    return msgspec.json.decode(path.read_bytes(), type=LatentRGB)


def preview_map(
    source: str,
    published_as: str,
    channels: int,
    decode: Callable[[torch.Tensor], torch.Tensor],
    scale: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> LatentRGB:
    """A model's map: one written beside the checkpoint (fitted for our own models) wins over the factors published
    for its VAE (`published_as`); a checkpoint with neither gets one fitted against its decoder (`decode`) now."""
    if os.path.isdir(source):
        fitted = load_preview_factors(source)
        if fitted is not None:
            return fitted
    found = published(published_as)
    if found is not None and len(found.factors) == channels:
        return found
    return fit_decoder(decode, channels, scale, device=device, dtype=dtype)
