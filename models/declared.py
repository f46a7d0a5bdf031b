"""What a checkpoint declares about itself beside `model_index.json` (diffusers has no place for it): serving defaults
and what it serves well. Read without loading the model, so `generate` and the server refuse a request the model
cannot serve before any work starts.

    {"name": "diffusiond-shapes", "width": 64, "height": 64, "num_inference_steps": 16, "guidance_scale": 2.0,
     "sizes": [[64, 64]], "steps": [4, 100], "guidance": [0, 10], "negative_prompt": false,
     "vocabulary": ["a", "red", ...], "draws": "one shape ..."}

Every key is optional: a checkpoint without the file is served with its family's defaults and limits.
"""

from __future__ import annotations

import os
import re

import msgspec

from diffusiond.models.params import SamplingParams

DEFAULTS_FILE = "diffusiond.json"
WORD = re.compile(r"[a-z]+")


class Declared(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # The name it is served under (`/v1/models`, responses), unless --served-model-name says otherwise.
    name: str | None = None
    # Serving defaults: a model trained for 64x64 images and 16 steps should not be served at its family's
    # 1024x1024 and 28 steps.
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    # What it serves well; anything else is refused with a 400 naming the field. None: the family's limits.
    sizes: list[tuple[int, int]] | None = None
    steps: tuple[int, int] | None = None
    guidance: tuple[float, float] | None = None
    negative_prompt: bool = True
    # Words it was trained on: others are reported back to the client (not refused). None: open vocabulary.
    vocabulary: frozenset[str] | None = None
    # What it can draw, in a sentence, for people (`/v1/models`, the playground).
    draws: str | None = None


def read_declared(source: str) -> Declared:
    path = os.path.join(source, DEFAULTS_FILE)
    if not os.path.isfile(path):
        return Declared()
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=Declared)


def check_declared(declared: Declared, params: SamplingParams) -> None:
    """Raises ParamError when a request asks for what the checkpoint does not serve. Sizes, steps and guidance left
    out are the model's defaults, which it serves by definition."""
    from diffusiond.models.params import ParamError

    width = params.width if params.width is not None else declared.width
    height = params.height if params.height is not None else declared.height
    # msgspec decodes the pairs as tuples.
    if declared.sizes and width is not None and height is not None and (width, height) not in declared.sizes:
        sizes = ", ".join(f"{w}x{h}" for w, h in declared.sizes)
        param = "width" if params.width is not None else "height"
        raise ParamError(param, f"this model draws {sizes} only, not {width}x{height}")
    for name, bounds in (("num_inference_steps", declared.steps), ("guidance_scale", declared.guidance)):
        value = getattr(params, name)
        if bounds and value is not None and not bounds[0] <= value <= bounds[1]:
            raise ParamError(
                name, f"{name} must be between {bounds[0]:g} and {bounds[1]:g} for this model, got {value:g}"
            )
    if not declared.negative_prompt and params.negative_prompt and params.negative_prompt.strip():
        raise ParamError("negative_prompt", "this model takes no negative prompt")


def unknown_words(vocabulary: frozenset[str] | None, text: str) -> list[str]:
    """Words of `text` outside the model's vocabulary, in order of first use, lower case."""
    if vocabulary is None:
        return []
    seen: dict[str, None] = {}
    for word in WORD.findall(text.lower()):
        if word not in vocabulary:
            seen.setdefault(word, None)
    return list(seen)
