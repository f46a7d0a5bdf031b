"""Engine images -> bytes, the way diffusers turns its float arrays into PIL images, in a pool of its own."""

from __future__ import annotations

import concurrent.futures
import io
import os

import numpy as np
from PIL import Image

# An image of at most this many pixels (64x64) is encoded where it is asked for, not in the pool: about 0.3 ms as
# PNG (under 1 ms as WebP), less than a thread hop costs while the step thread runs (streaming.py `encode_small`).
INLINE_PIXELS = 64 * 64


def answer_images(image: np.ndarray, layers: bool) -> list[np.ndarray]:
    """The images of one request's answer: each layer of a model that answers several (`Capabilities.layers`:
    Qwen-Image-Layered's [layers, H, W, 4]), else the one image."""
    return list(image) if layers else [image]


def to_uint8(image: np.ndarray) -> np.ndarray:
    """float [H, W, 3] in [0, 1] -> uint8, rounding as diffusers' `numpy_to_pil`."""
    if image.dtype == np.uint8:
        return image
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_image(image: np.ndarray, fmt: str = "png", quality: int | None = None, opaque: bool = False) -> bytes:
    """float or uint8 [H, W, 3] (or RGBA [H, W, 4]: Qwen-Image 2.1) -> `fmt` bytes; an RGBA image asked `opaque`
    (OpenAI's `background`), or as JPEG, which has no alpha, is composited over white."""
    pil = Image.fromarray(to_uint8(image))
    if pil.mode == "RGBA" and (opaque or fmt in ("jpeg", "jpg")):
        white = Image.new("RGB", pil.size, (255, 255, 255))
        white.paste(pil, mask=pil.getchannel("A"))
        pil = white
    buf = io.BytesIO()
    kwargs = {} if quality is None or fmt == "png" else {"quality": quality}
    pil.save(buf, format={"jpg": "jpeg"}.get(fmt, fmt).upper(), **kwargs)
    return buf.getvalue()


def encode_preview(image: np.ndarray, size: tuple[int, int], fmt: str = "png", quality: int | None = None) -> bytes:
    """A latent-resolution preview, scaled up to the requested image size (OpenAI partial images have it)."""
    pil = Image.fromarray(to_uint8(image)).resize(size, Image.Resampling.BILINEAR)
    return encode_image(np.asarray(pil), fmt, quality)


def gray_png(width: int, height: int) -> bytes:
    """A plain gray PNG, as a client would send an input image (the warm-up's, the field probe's)."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()


def encoder_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for image encoding (numpy and PIL only, never torch), off the event loop. Few of them: on a CPU that the
    step thread's torch threads keep busy, every extra busy thread slows every forward. Measured on 2 cores, 8
    concurrent 256x256 requests: with the default pool (6 threads) the 8 PNGs took 39 ms each instead of 7.5 ms and
    each forward 7% longer (6.1 images/s); with one thread, 6.3-6.5 images/s. (At the lowest CPU priority the encoder
    starved, answers trickled out and the clients' next requests no longer arrived together: 5.8 images/s.)"""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(2, min(4, cores // 4))
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="diffusiond-encode")
