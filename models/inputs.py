"""Images that requests bring (img2img, edits): checked once where they arrive, decoded on every rank.

A request carries the file its client sent (PNG, JPEG, WebP...), not pixels: it crosses the wire once and is
smaller than its pixels. `check_image` decodes it fully at the HTTP edge, off the event loop, so that a broken or
hostile file is refused with a 400 naming its field; `image_size` reads only the header (cheap enough for
`ModelAdapter.resolve`); `open_rgb` decodes it where the request is prepared.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps

from diffusiond.models.params import ParamError

# Larger inputs are refused before they are decoded (PIL's own bomb guard stops at 2 x 89 Mpx, and only warns
# below): 64 Mpx is 8192 x 8192, four times the largest image any family here generates.
MAX_INPUT_PIXELS = 64 << 20
# Modes that become RGB without losing their meaning. 16-bit and float images ("I", "I;16", "F") would be clipped
# to 8 bits silently.
MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "RGBX"})


def _open(data: bytes, param: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ParamError(param, f"{param} is too large to decode") from None
    except Exception as exc:  # PIL raises several types for files it cannot read
        raise ParamError(param, f"{param} is not an image PIL can read ({type(exc).__name__})") from None
    width, height = image.size
    if width * height > MAX_INPUT_PIXELS:
        raise ParamError(param, f"{param} is {width}x{height}; at most {MAX_INPUT_PIXELS} pixels are accepted")
    if image.mode not in MODES:
        raise ParamError(param, f"{param} has mode {image.mode}; send an 8-bit RGB, RGBA or grayscale image")
    return image


def image_size(data: bytes, param: str = "image") -> tuple[int, int]:
    """(width, height) from the file's header; ParamError when it is not an image we take."""
    return _open(data, param).size


def check_image(data: bytes, param: str = "image") -> tuple[int, int]:
    """Decode the whole file (a truncated or corrupt one fails here, not on a rank); its (width, height)."""
    image = _open(data, param)
    try:
        image.load()
    except Exception as exc:
        raise ParamError(param, f"{param} could not be decoded ({type(exc).__name__}: {exc})") from None
    return image.size


def open_rgb(data: bytes) -> Image.Image:
    """The decoded image in RGB, as the pipelines expect it (alpha dropped)."""
    image = _open(data, "image")
    return image if image.mode == "RGB" else image.convert("RGB")


def open_mask(data: bytes) -> Image.Image:
    """An inpainting mask in "L", white where the image is repainted. A file with alpha follows OpenAI's edits
    convention (transparent pixels are repainted); one without, diffusers' (white pixels are)."""
    image = _open(data, "mask")
    if "A" in image.getbands() or "transparency" in image.info:
        return ImageOps.invert(image.convert("RGBA").getchannel("A"))
    return image.convert("L")
