"""Prompt adherence for the demo model: does an image show the scene its caption describes?

Simple image analysis, no learned parts:

- background: the median colour of the image border (a 2 px ring), snapped to the nearest palette colour;
- shape pixels: the largest 4-connected blob of pixels more than half-way (in RGB distance) from the measured
  background towards the most distant colour in the image;
- shape colour: the median of the blob's core pixels, snapped to the nearest palette colour;
- coverage: each pixel's fraction of shape colour, projecting it on the background -> shape colour segment, so an
  anti-aliased (or blurred) edge counts partially; restricted to the blob grown by one pixel;
- width and height: sums over columns (rows) of the largest coverage in that column (row), which measure the
  bounding box to sub-pixel precision;
- kind: the fill ratio, area / (width * height): a circle fills pi/4 ~ 0.785 of its box, a square 1.0 and the
  upward triangle 0.5; decision boundaries at 0.655 and 0.895;
- position: the cell of the 3x3 grid (thirds of the image) holding the centre of the box;
- size: "large" when the box's larger side exceeds 16 px (nominal sides are 12 and 20 px at 64x64).

`judge(caption, image)` returns a `Verdict` with one boolean per attribute; `accuracy(pairs)` averages them over
many (caption, image) pairs. Images may be uint8 [H, W, 3] or float [H, W, 3] in [0, 1]; sizes other than 64 px are
measured in units of the image side.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from diffusiond.tools.demo.scenes import COLOURS, IMAGE_SIZE, POSITIONS, SIZES, Scene, parse_caption

ATTRIBUTES: tuple[str, ...] = ("background", "colour", "shape", "position", "size")

_PALETTE_NAMES = list(COLOURS)
_PALETTE = np.array([COLOURS[n] for n in _PALETTE_NAMES], dtype=np.float32)  # [K, 3]
BORDER = 2
# Shape pixels must be at least this far (RGB distance, 0-255 scale) from the background.
MIN_CONTRAST = 60.0
TRIANGLE_BELOW = 0.655
SQUARE_ABOVE = 0.895
LARGE_ABOVE = (SIZES["small"] + SIZES["large"]) / 2  # px at 64x64
_CELL_OF = {cell: name for name, cell in POSITIONS.items()}


@dataclass(frozen=True)
class Analysis:
    """What the image shows; shape fields are None when no shape was found."""

    background: str
    colour: str | None
    shape: str | None
    position: str | None
    size: str | None
    fill: float | None = None
    width: float | None = None
    height: float | None = None


@dataclass(frozen=True)
class Verdict:
    expected: Scene
    seen: Analysis
    background: bool
    colour: bool
    shape: bool
    position: bool
    size: bool

    def as_dict(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in ATTRIBUTES}

    @property
    def all(self) -> bool:
        return all(self.as_dict().values())


def _as_rgb255(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"expected an [H, W, 3] image, got shape {image.shape}")
    if image.dtype == np.uint8:
        return image.astype(np.float32)
    return np.clip(image.astype(np.float32), 0.0, 1.0) * 255.0


def nearest_colour(rgb: np.ndarray) -> str:
    return _PALETTE_NAMES[int(np.argmin(((_PALETTE - rgb[None]) ** 2).sum(-1)))]


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (flood fill; images are small)."""
    h, w = mask.shape
    labels = np.zeros((h, w), dtype=np.int32)
    best_label, best_size, label = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if labels[y0, x0]:
            continue
        label += 1
        labels[y0, x0] = label
        stack = [(int(y0), int(x0))]
        size = 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    stack.append((ny, nx))
        if size > best_size:
            best_label, best_size = label, size
    return labels == best_label if best_size else np.zeros_like(mask)


def _dilate(mask: np.ndarray) -> np.ndarray:
    out = mask.copy()
    out[1:] |= mask[:-1]
    out[:-1] |= mask[1:]
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    return out


def analyse(image: np.ndarray) -> Analysis:
    img = _as_rgb255(image)
    h, w, _ = img.shape
    sides = (img[:BORDER], img[-BORDER:], img[:, :BORDER], img[:, -BORDER:])
    border = np.concatenate([side.reshape(-1, 3) for side in sides])
    bg = np.median(border, axis=0)
    background = nearest_colour(bg)
    dist = np.sqrt(((img - bg) ** 2).sum(-1))  # [H, W]
    far = float(np.percentile(dist, 99.5))
    if far < MIN_CONTRAST:
        return Analysis(background, None, None, None, None)
    blob = _largest_component(dist > far / 2)
    core = blob & (dist >= 0.75 * far)
    fg = np.median(img[core if core.any() else blob], axis=0)
    colour = nearest_colour(fg)
    direction = fg - bg
    alpha = np.clip(((img - bg) @ direction) / float(direction @ direction), 0.0, 1.0) * _dilate(blob)
    cols = alpha.max(axis=0)
    rows = alpha.max(axis=1)
    width, height = float(cols.sum()), float(rows.sum())
    fill = float(alpha.sum()) / max(width * height, 1e-6)
    if fill < TRIANGLE_BELOW:
        shape = "triangle"
    elif fill > SQUARE_ABOVE:
        shape = "square"
    else:
        shape = "circle"
    xs, ys = np.nonzero(cols > 0.5)[0], np.nonzero(rows > 0.5)[0]
    if len(xs) == 0 or len(ys) == 0:
        return Analysis(background, colour, shape, None, None, fill, width, height)
    cx, cy = (xs[0] + xs[-1] + 1) / 2, (ys[0] + ys[-1] + 1) / 2
    cell = (min(int(3 * cy / h), 2), min(int(3 * cx / w), 2))
    side = max(width / w, height / h) * IMAGE_SIZE
    size = "large" if side > LARGE_ABOVE else "small"
    return Analysis(background, colour, shape, _CELL_OF[cell], size, fill, width, height)


def judge(caption: str | Scene, image: np.ndarray) -> Verdict:
    """Per-attribute verdict of `image` against the scene `caption` describes."""
    expected = caption if isinstance(caption, Scene) else parse_caption(caption)
    seen = analyse(image)
    return Verdict(
        expected=expected,
        seen=seen,
        background=seen.background == expected.background,
        colour=seen.colour == expected.colour,
        shape=seen.shape == expected.shape,
        position=seen.position == expected.position,
        size=seen.size == expected.size,
    )


def accuracy(pairs: Iterable[tuple[str | Scene, np.ndarray]]) -> dict[str, float]:
    """Fraction of images judged right, per attribute, plus "all" (every attribute right) and "n"."""
    verdicts = [judge(caption, image) for caption, image in pairs]
    if not verdicts:
        raise ValueError("accuracy of no images")
    out = {name: float(np.mean([getattr(v, name) for v in verdicts])) for name in ATTRIBUTES}
    out["all"] = float(np.mean([v.all for v in verdicts]))
    out["n"] = float(len(verdicts))
    return out


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """A Markdown table of `accuracy` results, one row per label."""
    head = ["", *ATTRIBUTES, "all", "n"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, acc in rows.items():
        cells = [f"{100 * acc[a]:.1f}%" for a in (*ATTRIBUTES, "all")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {int(acc['n'])} |")
    return "\n".join(lines)
