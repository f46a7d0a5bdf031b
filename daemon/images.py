"""Engine images -> bytes, the way diffusers turns its float arrays into PIL images."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def to_uint8(image: np.ndarray) -> np.ndarray:
    """float [H, W, 3] in [0, 1] -> uint8, rounding as diffusers' `numpy_to_pil`."""
    if image.dtype == np.uint8:
        return image
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_image(image: np.ndarray, fmt: str = "png", quality: int | None = None) -> bytes:
    pil = Image.fromarray(to_uint8(image))
    buf = io.BytesIO()
    kwargs = {} if quality is None or fmt == "png" else {"quality": quality}
    pil.save(buf, format={"jpg": "jpeg"}.get(fmt, fmt).upper(), **kwargs)
    return buf.getvalue()


def encode_preview(image: np.ndarray, size: tuple[int, int], fmt: str = "png", quality: int | None = None) -> bytes:
    """A latent-resolution preview, scaled up to the requested image size (OpenAI partial images have it)."""
    pil = Image.fromarray(to_uint8(image)).resize(size, Image.Resampling.BILINEAR)
    return encode_image(np.asarray(pil), fmt, quality)
