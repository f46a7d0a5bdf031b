"""Images that requests bring (img2img, edits): checked once where they arrive, decoded on every rank.

A request carries the file its client sent (PNG, JPEG, WebP...), not pixels: it crosses the wire once and is
smaller than its pixels. `check_image` decodes it fully at the HTTP edge, off the event loop, so that a broken or
hostile file is refused with a 400 naming its field; `image_size` reads only the header (cheap enough for
`ModelAdapter.resolve`); `open_rgb` decodes it where the request is prepared, once for all the copies of one request
(an edit with n=10 is ten requests with the same file).

What a file may cost to decode is bounded before it is decoded: its format must be one of FORMATS (PIL would
otherwise run, for instance, Ghostscript on an EPS file), and its header's size must be within `input_pixel_limit` of
the model's largest output (an 8192 x 8192 PNG of zeros is ~200 KB of file and 200 MB of pixels).
"""

from __future__ import annotations

import io
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


def check_image(data: bytes, param: str = "image", max_pixels: int = MAX_INPUT_PIXELS) -> tuple[int, int]:
    """Decode the whole file (a truncated or corrupt one fails here, not on a rank); its (width, height). A file
    over `max_pixels` is refused from its header, before it is decoded."""
    image = _open(data, param, max_pixels)
    try:
        image.load()
    except Exception as exc:
        raise ParamError(param, f"{param} could not be decoded ({type(exc).__name__}: {exc})") from None
    return image.size


class Decoded:
    """The last few input images decoded, by their file's bytes (hashed once per bytes object, compared on a hit):
    the copies of one request decode its file once. Callers never change the images they get."""

    def __init__(self, size: int = DECODED) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[str, bytes], Image.Image] = OrderedDict()
        self.decodes = 0

    def get(self, kind: str, data: bytes, decode: Callable[[bytes], Image.Image]) -> Image.Image:
        key = (kind, data)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
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


DECODED_INPUTS = Decoded()


def open_rgb(data: bytes) -> Image.Image:
    """The decoded image in RGB, as the pipelines expect it (alpha dropped)."""
    return DECODED_INPUTS.get("rgb", data, _rgb)


def open_mask(data: bytes) -> Image.Image:
    """An inpainting mask in "L", white where the image is repainted. A file with alpha follows OpenAI's edits
    convention (transparent pixels are repainted); one without, diffusers' (white pixels are)."""
    return DECODED_INPUTS.get("mask", data, _mask)


def _rgb(data: bytes) -> Image.Image:
    image = _open(data, "image")
    return image if image.mode == "RGB" else image.convert("RGB")


def _mask(data: bytes) -> Image.Image:
    image = _open(data, "mask")
    if "A" in image.getbands() or "transparency" in image.info:
        return ImageOps.invert(image.convert("RGBA").getchannel("A"))
    return image.convert("L")
