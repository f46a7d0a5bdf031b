"""Images that requests bring (img2img, edits): decoded once where they arrive, and on the other ranks of a group.

A request carries the file its client sent (PNG, JPEG, WebP...), not pixels: it crosses the wire once and is
smaller than its pixels (3-10x for photographs). `admit_image` decodes it fully at the HTTP edge, in the encoder
pool (off the event loop and off the step thread), so that a broken or hostile file is refused with a 400 naming its
field, and keeps the decoded image for the step thread of the same process (`ADMITTED`, bounded by pixels): on a
single process, and on rank 0 of a group, preparing a request decodes nothing. `image_size` reads only the header
(cheap enough for `ModelAdapter.resolve`); `open_rgb` and `open_mask` give the step thread the admitted image, or
decode the file there (the other ranks of a group, inputs the budget let go), once for all the copies of one
request (an edit with n=10 is ten requests with the same file).

What a file may cost to decode is bounded before it is decoded: its format must be one of FORMATS (PIL would
otherwise run, for instance, Ghostscript on an EPS file), and its header's size must be within `input_pixel_limit` of
the model's largest output (an 8192 x 8192 PNG of zeros is ~200 KB of file and 200 MB of pixels).
"""

from __future__ import annotations

import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable

from PIL import Image, ImageOps

from diffusiond.models.params import ParamError

# Larger inputs are refused before they are decoded (PIL's own bomb guard stops at 2 x 89 Mpx, and only warns
# below): 64 Mpx is 8192 x 8192, four times the largest image any family here generates.
MAX_INPUT_PIXELS = 64 << 20
# Modes that become RGB without losing their meaning. 16-bit and float images ("I", "I;16", "F") would be clipped
# to 8 bits silently.
MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "RGBX"})


# The formats clients send images in; PIL opens many more (EPS through Ghostscript, PSD, ICNS...).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# An input may be larger than what the model makes (it is resized down), up to this many times its largest output,
# and never below MIN_INPUT_PIXELS (2048 x 2048), for models whose outputs are small.
INPUT_OVER_OUTPUT = 4
MIN_INPUT_PIXELS = 4 << 20
# Decoded inputs kept for the requests prepared next (the copies of one request come together).
DECODED = 4


def input_pixel_limit(max_pixels: int | None) -> int:
    """The most pixels an input image may have for a server whose largest output is `max_pixels`."""
    if max_pixels is None:
        return MAX_INPUT_PIXELS
    return min(MAX_INPUT_PIXELS, max(INPUT_OVER_OUTPUT * max_pixels, MIN_INPUT_PIXELS))


def _open(data: bytes, param: str, max_pixels: int = MAX_INPUT_PIXELS) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ParamError(param, f"{param} is too large to decode") from None
    except Exception as exc:  # PIL raises several types for files it cannot read
        raise ParamError(
            param, f"{param} is not an image in a format taken here ({', '.join(FORMATS)}; {type(exc).__name__})"
        ) from None
    width, height = image.size
    if width * height > max_pixels:
        raise ParamError(param, f"{param} is {width}x{height}; at most {max_pixels} pixels are accepted here")
    if image.mode not in MODES:
        raise ParamError(param, f"{param} has mode {image.mode}; send an 8-bit RGB, RGBA or grayscale image")
    return image


def image_size(data: bytes, param: str = "image") -> tuple[int, int]:
    """(width, height) from the file's header; ParamError when it is not an image we take."""
    return _open(data, param).size


def check_image(data: bytes, param: str = "image", max_pixels: int = MAX_INPUT_PIXELS) -> Image.Image:
    """Decode the whole file (a truncated or corrupt one fails here, not on a rank); the decoded image. A file
    over `max_pixels` is refused from its header, before it is decoded."""
    image = _open(data, param, max_pixels)
    try:
        image.load()
    except Exception as exc:
        raise ParamError(param, f"{param} could not be decoded ({type(exc).__name__}: {exc})") from None
    return image


def admit_image(data: bytes, param: str = "image", max_pixels: int = MAX_INPUT_PIXELS) -> tuple[int, int]:
    """`check_image`, then the image in the form the step thread prepares it in (RGB, or a mask's "L"), kept for
    it in ADMITTED; the file's (width, height). Thread-safe: the encoder pool runs it."""
    image = check_image(data, param, max_pixels)
    kind = "mask" if param == "mask" else "rgb"
    ADMITTED.put(kind, data, _as_mask(image) if kind == "mask" else _as_rgb(image))
    return image.size


class Admitted:
    """Inputs decoded where they arrived, for the step thread of the same process, by their file's bytes; the
    oldest go past `budget` pixels (the step thread then decodes those itself). Shared by the encoder pool and the
    step thread, under a lock; images in it are never changed."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, bytes], Image.Image] = OrderedDict()
        self._pixels = 0
        self.hits = 0

    def put(self, kind: str, data: bytes, image: Image.Image) -> None:
        with self._lock:
            if (kind, data) in self._entries:
                self._entries.move_to_end((kind, data))
                return
            self._entries[(kind, data)] = image
            self._pixels += image.width * image.height
            while self._pixels > self.budget and self._entries:
                _, old = self._entries.popitem(last=False)
                self._pixels -= old.width * old.height

    def get(self, kind: str, data: bytes) -> Image.Image | None:
        with self._lock:
            image = self._entries.get((kind, data))
            if image is not None:
                self._entries.move_to_end((kind, data))
                self.hits += 1
            return image


class Decoded:
    """The step thread's input images of this step, by their file's bytes (hashed once per bytes object, compared on
    a hit): the copies of one request take its image once. Admitted images first (`ADMITTED`); `decodes` counts the
    files the step thread had to decode itself. Callers never change the images they get."""

    def __init__(self, size: int = DECODED) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[str, bytes], Image.Image] = OrderedDict()
        self.decodes = 0

    def get(self, kind: str, data: bytes, decode: Callable[[bytes], Image.Image]) -> Image.Image:
        key = (kind, data)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        image = ADMITTED.get(kind, data)
        if image is None:
            image = decode(data)
            image.load()
            self.decodes += 1
        self.entries[key] = image
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return image

    def clear(self) -> None:
        """After the requests of a step are prepared: nothing decoded outlives the step that needed it."""
        self.entries.clear()


# Decoded inputs waiting for their requests to be prepared, at most this many pixels (64 Mpx: 192 MB as RGB).
ADMITTED_PIXELS = 64 << 20
ADMITTED = Admitted(ADMITTED_PIXELS)
DECODED_INPUTS = Decoded()


def open_rgb(data: bytes) -> Image.Image:
    """The decoded image in RGB, as the pipelines expect it (alpha dropped)."""
    return DECODED_INPUTS.get("rgb", data, _rgb)


def open_rgba(data: bytes) -> Image.Image:
    """The decoded image in RGBA (opaque where the file has no alpha): Qwen-Image 2.1 reads its condition images so."""
    return DECODED_INPUTS.get("rgba", data, lambda d: _open(d, "image").convert("RGBA"))


def open_mask(data: bytes) -> Image.Image:
    """An inpainting mask in "L", white where the image is repainted. A file with alpha follows OpenAI's edits
    convention (transparent pixels are repainted); one without, diffusers' (white pixels are)."""
    return DECODED_INPUTS.get("mask", data, _mask)


def _rgb(data: bytes) -> Image.Image:
    return _as_rgb(_open(data, "image"))


def _mask(data: bytes) -> Image.Image:
    return _as_mask(_open(data, "mask"))


def _as_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def _as_mask(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or "transparency" in image.info:
        return ImageOps.invert(image.convert("RGBA").getchannel("A"))
    return image.convert("L")
