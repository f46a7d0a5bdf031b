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
import re
import zlib
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


# The words of the canonical grammar (v1 of the model knew these only), then the words of the caption variants
# (`describe`): synonyms, other position and background phrases, "shape" for a shape left unnamed. Every word becomes
# a single token of the demo model's CLIP tokenizers (punctuation, "," and "-", is one token anyway).
GRAMMAR_WORDS: tuple[str, ...] = tuple(
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
SYNONYMS: dict[str, tuple[str, ...]] = {
    "small": ("small", "little", "tiny"),
    "large": ("large", "big"),
    "circle": ("circle", "ball", "dot", "disc"),
    "square": ("square", "box"),
    "triangle": ("triangle",),
}
CENTRE_WORDS: tuple[str, ...] = ("center", "centre", "middle")
ROW_WORDS: dict[int, tuple[str, ...]] = {0: ("top", "upper"), 2: ("bottom", "lower")}
COLUMN_WORDS: dict[int, str] = {0: "left", 2: "right"}
VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            *GRAMMAR_WORDS,
            *(w for words in SYNONYMS.values() for w in words),
            *CENTRE_WORDS,
            *(w for words in ROW_WORDS.values() for w in words),
            *("corner", "side", "with", "against", "shape"),
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


# --------------------------------------------------------------------------------------------------- caption variants
#
# Demo model v2 is trained on many phrasings of each scene, not on the grammar alone: any attribute may be left out
# (the image then shows whatever the scene has there, so the model learns to pick one), the parts of a caption come
# in any order, and words have common synonyms. A caption's phrasing is every choice `describe` makes apart from
# the scene: which attributes it names, their order, the article, the adjective order, each synonym and the
# template of each phrase. A fixed tenth of all phrasings (by a hash of those choices) is held out of training, as
# a tenth of the scene combinations is, so evaluation can use captions whose wording was never seen; phrasings in
# the grammar's own words and order (any attributes left out) are always trained.

ATTRIBUTE_ORDER: tuple[str, ...] = ("size", "colour", "shape", "position", "background")
# Phrase templates. Corners: v is top/upper or bottom/lower, h left/right; top and bottom edges: v is top or bottom,
# c a centre word; left and right edges: h; the centre: c. The first template of each kind is the grammar's.
CORNER_PHRASES: tuple[str, ...] = (
    "at the {v} {h}",
    "in the {v} {h}",
    "in the {v} {h} corner",
    "at the {v} {h} corner",
    "{v} {h}",
    "at the {v}-{h}",
)
EDGE_ROW_PHRASES: tuple[str, ...] = ("at the {v}", "at the {v} {c}", "in the {v} {c}", "{v} {c}")
EDGE_COLUMN_PHRASES: tuple[str, ...] = ("on the {h}", "at the {h}", "on the {h} side", "{h}")
CENTRE_PHRASES: tuple[str, ...] = ("in the {c}", "at the {c}", "{c}")
BACKGROUND_PHRASES: tuple[str, ...] = (
    "on a {b} background",
    "with a {b} background",
    "against a {b} background",
    "{b} background",
    "on {b}",
)
ARTICLES: tuple[str, ...] = ("a", "the", "")
# Most tokens a caption may have between the CLIP tokenizer's start and end tokens (16 in all).
MAX_CAPTION_TOKENS = 14
HELD_OUT_PHRASINGS = 10  # one phrasing in this many is held out
# Training captions name every attribute this often; otherwise each attribute is named with NAME_PROBABILITY.
FULL_CAPTION_PROBABILITY = 0.3
NAME_PROBABILITY = 0.55
# Captions in the grammar's own words and order (with attributes left out as above), as v1 was trained on.
GRAMMAR_PROBABILITY = 0.2
_TOKEN = re.compile(r"[a-z]+|[^\sa-z]")


@dataclass(frozen=True)
class Caption:
    text: str
    named: tuple[str, ...]  # the attributes it names, in ATTRIBUTE_ORDER
    phrasing: tuple  # every choice but the scene
    held_out: bool  # its phrasing is never trained on


def tokens(text: str) -> list[str]:
    """How the demo tokenizer splits a caption: words and single punctuation marks."""
    return _TOKEN.findall(text.lower())


def phrasing_held_out(phrasing: tuple) -> bool:
    if all(choice == 0 for choice in _flat_choices(phrasing)):
        return False  # the grammar's own words and order
    return zlib.crc32(repr(phrasing).encode()) % HELD_OUT_PHRASINGS == 0


def _flat_choices(phrasing: tuple) -> list[int]:
    """The index-valued choices of a phrasing; all 0 is the grammar's wording (the order is checked separately)."""
    _named, order, choices = phrasing
    canonical_order = [part for part in ("object", "position", "background") if part in order]
    return [*choices.values(), 0 if list(order) == canonical_order else 1]


class _Picker:
    """Random choices, or the grammar's (always the first option) for a caption in the grammar's own words."""

    def __init__(self, rng: np.random.Generator, grammar: bool) -> None:
        self.rng = rng
        self.grammar = grammar

    def __call__(self, n: int) -> int:
        return 0 if self.grammar else int(self.rng.integers(n))

    def chance(self, p: float) -> bool:
        return False if self.grammar else bool(self.rng.random() < p)


def _position_phrase(position: str, pick: _Picker) -> tuple[str, tuple[int, ...]]:
    row, col = POSITIONS[position]
    if row != 1 and col != 1:
        template, v = pick(len(CORNER_PHRASES)), pick(2)
        return CORNER_PHRASES[template].format(v=ROW_WORDS[row][v], h=COLUMN_WORDS[col]), (template, v)
    if row != 1:
        template, c = pick(len(EDGE_ROW_PHRASES)), pick(len(CENTRE_WORDS))
        return EDGE_ROW_PHRASES[template].format(v=ROW_WORDS[row][0], c=CENTRE_WORDS[c]), (template, c)
    if col != 1:
        template = pick(len(EDGE_COLUMN_PHRASES))
        return EDGE_COLUMN_PHRASES[template].format(h=COLUMN_WORDS[col]), (template, 0)
    template, c = pick(len(CENTRE_PHRASES)), pick(len(CENTRE_WORDS))
    return CENTRE_PHRASES[template].format(c=CENTRE_WORDS[c]), (template, c)


def _propose(scene: Scene, named: tuple[str, ...], rng: np.random.Generator) -> Caption:
    pick = _Picker(rng, grammar=bool(rng.random() < GRAMMAR_PROBABILITY))
    choices: dict[str, int] = {}
    parts: dict[str, str] = {}
    adjectives = []
    if "size" in named:
        choices["size"] = pick(len(SYNONYMS[scene.size]))
        adjectives.append(SYNONYMS[scene.size][choices["size"]])
    if "colour" in named:
        adjectives.append(scene.colour)
    if len(adjectives) == 2:
        choices["adjective order"] = int(pick.chance(0.2))
        if choices["adjective order"]:
            adjectives.reverse()
    if "shape" in named:
        choices["shape"] = pick(len(SYNONYMS[scene.shape]))
        noun = SYNONYMS[scene.shape][choices["shape"]]
    else:
        noun = "shape"
    if adjectives or "shape" in named or not named or rng.random() < 0.5:
        choices["article"] = pick(len(ARTICLES))
        parts["object"] = " ".join(w for w in (ARTICLES[choices["article"]], *adjectives, noun) if w)
    if "position" in named:
        parts["position"], (choices["position"], choices["position word"]) = _position_phrase(scene.position, pick)
    if "background" in named:
        choices["background"] = pick(len(BACKGROUND_PHRASES))
        parts["background"] = BACKGROUND_PHRASES[choices["background"]].format(b=scene.background)
    order = list(parts)
    if pick.chance(0.5):  # half in the grammar's order, half in any order
        order = [order[i] for i in rng.permutation(len(order))]
    choices["separator"] = int(len(order) > 1 and pick.chance(0.3))
    text = (", " if choices["separator"] else " ").join(parts[p] for p in order)
    phrasing = (named, tuple(order), choices)
    return Caption(text=text, named=named, phrasing=phrasing, held_out=phrasing_held_out(phrasing))


def training_attributes(rng: np.random.Generator) -> tuple[str, ...]:
    """Which attributes a training caption names: all of them at times, otherwise each one at random."""
    if rng.random() < FULL_CAPTION_PROBABILITY:
        return ATTRIBUTE_ORDER
    return tuple(a for a in ATTRIBUTE_ORDER if rng.random() < NAME_PROBABILITY)


def describe(
    scene: Scene,
    rng: np.random.Generator,
    *,
    named: tuple[str, ...] | None = None,
    held_out: bool | None = False,
    tries: int = 10_000,
) -> Caption:
    """A caption of `scene` in a random phrasing: naming `named` (default: `training_attributes`), with a phrasing
    of the training split (held_out=False), of the held-out split (True) or of either (None)."""
    if named is None:
        named = training_attributes(rng)
    named = tuple(a for a in ATTRIBUTE_ORDER if a in named)
    for _ in range(tries):
        caption = _propose(scene, named, rng)
        if len(tokens(caption.text)) > MAX_CAPTION_TOKENS:
            continue
        if held_out is None or caption.held_out == held_out:
            return caption
    raise RuntimeError(f"no {'held-out' if held_out else 'training'} phrasing naming {named} for {scene}")
