"""Procedural scenes for the demo model: one shape on a plain background, and the caption grammar that names it.

A scene is (shape, colour, size, position, background). Its caption reads like
"a small red circle at the top left on a blue background". Images are 64x64 RGB, drawn with 4x4 supersampling so
edges are anti-aliased; every shape is drawn inside a square bounding box of side `size` px centred on the scene's
(jittered) anchor, so a circle fills ~0.785 of its box, a square 1.0 and an upward triangle 0.5.

The 3x3 position grid splits the image into thirds; anchors sit at 12, 32 and 52 px, inside their third with a
margin of >= 9 px, so a jitter of a few pixels never crosses a cell boundary (training images jitter the anchor by
up to 1 px and the size by up to 0.5 px). A fixed tenth of all scene
combinations is held out of training (`split()`), for evaluating prompt adherence on captions never trained on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 64
SUPERSAMPLE = 4

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 35, 35),
    "green": (35, 170, 50),
    "blue": (35, 70, 225),
    "yellow": (240, 215, 35),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Nominal bounding-box side in pixels.
SIZES: dict[str, float] = {"small": 12.0, "large": 20.0}
# Row-major 3x3 grid: (row, col) -> phrase.
POSITIONS: dict[str, tuple[int, int]] = {
    "top left": (0, 0),
    "top": (0, 1),
    "top right": (0, 2),
    "left": (1, 0),
    "center": (1, 1),
    "right": (1, 2),
    "bottom left": (2, 0),
    "bottom": (2, 1),
    "bottom right": (2, 2),
}
ANCHORS: tuple[float, float, float] = (12.0, 32.0, 52.0)
# How each position reads in a caption.
POSITION_PHRASES: dict[str, str] = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}
# Default jitter of training images: anchor +- 1 px, size +- 0.5 px. (The first two training stages of the shipped
# model used +- 2 px and +- 1 px; averaged over that much jitter, a square's expected image has rounded corners, and
# an underfit model drew squares as rounded blobs; see README.md.)
POSITION_JITTER = 1.0
SIZE_JITTER = 0.5

HELD_OUT_FRACTION = 0.1
SPLIT_SEED = 1234


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    size: str
    position: str
    background: str

    def __post_init__(self) -> None:
        if self.shape not in SHAPES or self.colour not in COLOURS or self.background not in COLOURS:
            raise ValueError(f"unknown shape or colour in {self}")
        if self.size not in SIZES or self.position not in POSITIONS:
            raise ValueError(f"unknown size or position in {self}")
        if self.colour == self.background:
            raise ValueError(f"shape and background have the same colour in {self}")

    @property
    def caption(self) -> str:
        return (
            f"a {self.size} {self.colour} {self.shape} {POSITION_PHRASES[self.position]} "
            f"on a {self.background} background"
        )


# Every word a caption can use: each becomes a single token of the demo model's CLIP tokenizers.
VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            *("a", "the", "at", "on", "in", "background"),
            *SIZES,
            *COLOURS,
            *SHAPES,
            *" ".join(POSITION_PHRASES.values()).split(),
        ]
    )
)

_CAPTIONS: dict[str, Scene] | None = None


def all_scenes() -> list[Scene]:
    """Every scene combination, in a fixed order."""
    return [
        Scene(shape, colour, size, position, background)
        for shape, colour, size, position, background in itertools.product(SHAPES, COLOURS, SIZES, POSITIONS, COLOURS)
        if colour != background
    ]


def split(seed: int = SPLIT_SEED, fraction: float = HELD_OUT_FRACTION) -> tuple[list[Scene], list[Scene]]:
    """(train, held_out): a fixed random `fraction` of all scene combinations is held out."""
    scenes = all_scenes()
    rng = np.random.default_rng(seed)
    held = set(rng.choice(len(scenes), size=round(len(scenes) * fraction), replace=False).tolist())
    train = [s for i, s in enumerate(scenes) if i not in held]
    held_out = [s for i, s in enumerate(scenes) if i in held]
    return train, held_out


def parse_caption(caption: str) -> Scene:
    """The scene a caption of the grammar describes; ValueError for any other text."""
    global _CAPTIONS
    if _CAPTIONS is None:
        _CAPTIONS = {s.caption: s for s in all_scenes()}
    scene = _CAPTIONS.get(" ".join(caption.lower().split()))
    if scene is None:
        raise ValueError(f"not a caption of the scene grammar: {caption!r}")
    return scene


def random_scene(rng: np.random.Generator, scenes: list[Scene] | None = None) -> Scene:
    if scenes is not None:
        return scenes[int(rng.integers(len(scenes)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colours = list(COLOURS)
    colour = colours[int(rng.integers(len(colours)))]
    background = [c for c in colours if c != colour][int(rng.integers(len(colours) - 1))]
    size = list(SIZES)[int(rng.integers(len(SIZES)))]
    position = list(POSITIONS)[int(rng.integers(len(POSITIONS)))]
    return Scene(shape, colour, size, position, background)


def geometry(scene: Scene) -> tuple[float, float, float]:
    """(centre x, centre y, side) of the scene's bounding box without jitter, in pixels."""
    row, col = POSITIONS[scene.position]
    return ANCHORS[col], ANCHORS[row], SIZES[scene.size]


def _coverage(shape: str, cx: float, cy: float, side: float) -> np.ndarray:
    """Fraction of each pixel covered by the shape, [64, 64] float32, via SUPERSAMPLE^2 samples per pixel."""
    n = IMAGE_SIZE * SUPERSAMPLE
    coords = (np.arange(n, dtype=np.float32) + 0.5) / SUPERSAMPLE
    x = coords[None, :]
    y = coords[:, None]
    half = side / 2
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= half**2
    elif shape == "square":
        inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    elif shape == "triangle":
        # Apex at the top centre of the box, base along its bottom edge.
        top, bottom = cy - half, cy + half
        t = (y - top) / side  # 0 at the apex, 1 at the base
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= t * half)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    pooled = inside.reshape(IMAGE_SIZE, SUPERSAMPLE, IMAGE_SIZE, SUPERSAMPLE).mean(axis=(1, 3))
    return pooled.astype(np.float32)


def render(
    scene: Scene,
    rng: np.random.Generator | None = None,
    *,
    position_jitter: float = POSITION_JITTER,
    size_jitter: float = SIZE_JITTER,
) -> np.ndarray:
    """The scene as a uint8 [64, 64, 3] image; with `rng`, the anchor and size are jittered uniformly."""
    cx, cy, side = geometry(scene)
    if rng is not None:
        cx += float(rng.uniform(-position_jitter, position_jitter))
        cy += float(rng.uniform(-position_jitter, position_jitter))
        side += float(rng.uniform(-size_jitter, size_jitter))
    cover = _coverage(scene.shape, cx, cy, side)[..., None]
    fg = np.array(COLOURS[scene.colour], dtype=np.float32)
    bg = np.array(COLOURS[scene.background], dtype=np.float32)
    image = bg + cover * (fg - bg)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def render_batch(
    scenes: list[Scene],
    rng: np.random.Generator | None = None,
    *,
    position_jitter: float = POSITION_JITTER,
    size_jitter: float = SIZE_JITTER,
) -> np.ndarray:
    """uint8 [N, 64, 64, 3]."""
    return np.stack([render(s, rng, position_jitter=position_jitter, size_jitter=size_jitter) for s in scenes])


def to_tensor_range(images: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W] in [-1, 1], the VAE's input range."""
    return (images.astype(np.float32) / 127.5 - 1.0).transpose(0, 3, 1, 2)
