"""Input images for edit and img2img tests, made here (no files in the repository, no hub).

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from pictures import ...`.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def picture(width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A smooth gradient with a few flat rectangles (structure a VAE keeps), encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 1, 3).astype(np.float32)
    image = np.stack([(base[c] + (x / width) * (c - 1) + (y / height) * (1 - c) * 0.5) % 1.0 for c in range(3)], -1)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        image[y0 : y0 + height // 3, x0 : x0 + width // 3] = rng.uniform(0, 1, 3)
    pil = Image.fromarray((image * 255).round().astype(np.uint8))
    pil = pil.convert("L").convert(mode) if mode.startswith("I") else pil.convert(mode)
    buf = io.BytesIO()
    pil.save(buf, format=fmt)
    return buf.getvalue()


def translucent(width: int, height: int, seed: int = 0) -> bytes:
    """`picture`'s PNG with an alpha channel that varies, left (40) to right (255): for models that read RGBA."""
    image = Image.open(io.BytesIO(picture(width, height, seed=seed))).convert("RGBA")
    alpha = np.linspace(40, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    image.putalpha(Image.fromarray(alpha.round().astype(np.uint8)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decoded(data: bytes) -> Image.Image:
    """What a pipeline is handed for the same file: PIL's decode, in RGB."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def mask(width: int, height: int, box: tuple[int, int, int, int], alpha: bool = False) -> tuple[bytes, Image.Image]:
    """An inpainting mask repainting `box` (x0, y0, x1, y1), as a PNG file and as the "L" image diffusers takes (white:
    repaint). `alpha`: the file in OpenAI's convention instead: RGBA, transparent where repainted."""
    white = Image.new("L", (width, height), 0)
    white.paste(255, box)
    if alpha:
        rgba = Image.new("RGBA", (width, height), (40, 90, 200, 255))
        rgba.putalpha(Image.eval(white, lambda v: 255 - v))
        image = rgba
    else:
        image = white
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), white
