"""Which request fields the loaded model takes, found by asking its own rules: each optional field is sent once, on
its own and beside an input image, through `Engine.resolve` (the family's `RequestRules.resolve`, the generic path's,
and the operator's limits), and what the model refuses naming that field is what the served OpenAPI document leaves
out (daemon/model_document.py `served_document`). One source of truth: the document cannot promise a field the resolver
refuses (a family's own guidance, step caching without `--cache`, video fields on an image model), whatever the
family, and it needs no family named here.

Run once a loaded model, on the event loop (resolving is arithmetic and a few header reads of a tiny image)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec.structs import replace

from diffusiond.daemon.image_encoding import gray_png
from diffusiond.models.params import MAX_GUIDANCE, ParamError, SamplingParams

if TYPE_CHECKING:
    from diffusiond.engine.engine import Engine

log = logging.getLogger("diffusiond.openapi")

# What a field does beside an input image (`image`): taken with or without one, only with one, only without one,
# or never (the document then allows it only as null, the same as leaving it out); the image itself may be required.
ANY, WITH_IMAGE, WITHOUT_IMAGE, NEVER, REQUIRED = "any", "with image", "without image", "never", "required"

# Fields whose values are checked against the model by size rather than taken or refused (their largest item).
LISTS = ("skip_guidance_layers", "stg_blocks")


def largest_square(caps: Any, max_pixels: int) -> int:
    """The side of the largest square image the model makes within `max_pixels` (a multiple of its size multiple,
    at most its largest side; at least one multiple)."""
    m = caps.size_multiple
    return max(m, min(caps.max_side, math.isqrt(max_pixels)) // m * m)


def _probes(engine: Engine) -> dict[str, Any]:
    """A value for each optional field that its type allows and that differs from the model's default."""
    caps = engine.adapter.capabilities
    side = max(caps.size_multiple, 16)
    image = gray_png(side, side)
    frames = 1 + (caps.frame_step or 4)
    return {
        "negative_prompt": "a probe",
        "guidance_scale": _other_guidance(caps),
        "true_cfg_scale": 2.0,
        "guidance_scale_2": 2.0,
        "audio_guidance_scale": 2.0,
        "stg_scale": 2.0,
        "audio_stg_scale": 2.0,
        "modality_scale": 2.0,
        "audio_modality_scale": 2.0,
        "guidance_rescale": 0.5,
        "audio_guidance_rescale": 0.5,
        "stg_blocks": (0,),
        "cache_threshold": 0.1,
        "cache_steps": (0,),
        "skip_guidance_layers": (0,),
        "skip_layer_guidance_scale": 2.0,
        "skip_layer_guidance_start": 0.05,
        "skip_layer_guidance_stop": 0.3,
        "image": image,
        "strength": 0.5,
        "mask": image,
        "reference_images": (image,),
        "edit_context": "auto",
        "num_frames": frames,
        "fps": caps.default_fps or 8,
        "arguments": {"probe": 1},
        "images": {"probe": image},
    }


def _other_guidance(caps: Any) -> float:
    """A guidance scale other than the default, within what the checkpoint declares."""
    low, high = caps.guidance or (0.0, MAX_GUIDANCE)
    return caps.default_guidance + 1.0 if caps.default_guidance + 1.0 <= high else max(low, caps.default_guidance - 1.0)


def _base(engine: Engine) -> SamplingParams:
    """The smallest request the server takes: one step at the smallest size (and frame count) it allows."""
    caps, limits = engine.adapter.capabilities, engine.limits
    steps = caps.steps[0] if caps.steps else 1  # the fewest it declares (models/declared.py)
    fields: dict[str, Any] = {"prompt": "a probe", "num_inference_steps": steps, "seed": 0}
    if caps.sizes:
        fields["width"], fields["height"] = min(caps.sizes, key=lambda size: size[0] * size[1])
    elif limits is not None and caps.default_width * caps.default_height > limits.max_pixels:
        fields["width"] = fields["height"] = largest_square(caps, limits.max_pixels)
    if caps.modality == "video" and caps.frame_step:
        fields["num_frames"] = 1 + caps.frame_step
    return SamplingParams(**fields)


def _takes(engine: Engine, params: SamplingParams, name: str) -> bool | None:
    """True when the model takes `params`, False when it refuses them naming `name`, None when it refuses them for
    another reason (the probe says nothing about `name`)."""
    try:
        engine.resolve(params)
    except ParamError as exc:
        return False if exc.param == name else None
    except (ValueError, TypeError, msgspec.ValidationError):
        return None
    return True


def field_rules(engine: Engine) -> tuple[tuple[str, str | int], ...]:
    """(field, what it does beside an image) for each optional field the model does not take everywhere, and (field,
    largest item) for the list fields it bounds by size; () when not even the smallest request resolves (nothing is
    left out of the document then: it stays the code's)."""
    probes = _probes(engine)
    image = probes["image"]
    base = _base(engine)
    rules: list[tuple[str, str | int]] = []
    if _takes(engine, base, "image") is False and _takes(engine, replace(base, image=image), "image"):
        base = replace(base, image=image)  # an instruction-edit model: every request edits an image
        rules.append(("image", REQUIRED))
    if _takes(engine, base, "prompt") is not True:
        log.warning("the OpenAPI document lists every field: the smallest request does not resolve (%s)", base)
        return ()
    with_image = replace(base, image=image)
    image_taken = _takes(engine, with_image, "image") is True
    taken: dict[str, Any] = {}  # the fields taken alone so far, with their probes
    generic = engine.adapter.capabilities.mode == "generic"
    image_required = bool(rules)  # ("image", REQUIRED): nothing to ask of the image itself
    for name, value in probes.items():
        if generic and name in ("arguments", "images"):  # the call's own names (model_document.py lists them)
            continue
        if name == "arguments" and engine.adapter.capabilities.call_arguments:  # a family's call switches, by name
            continue
        if name == "image" and image_required:
            continue
        alone = _takes(engine, replace(base, **{name: value}), name)
        if not image_taken:  # no request has an image: what is taken alone is taken by any request
            beside = bool(alone)
        else:
            beside = name == "image" or _takes(engine, replace(with_image, **{name: value}), name) is True
        if name == "image":
            rule = ANY if alone else NEVER
        elif alone and beside:
            rule = ANY
        elif alone:
            rule = WITHOUT_IMAGE
        elif beside:
            rule = WITH_IMAGE
        else:
            rule = NEVER
        if rule == NEVER:
            rule = _companion(engine, base, name, value, taken) or NEVER
        if rule != ANY:
            rules.append((name, rule))
        if alone:
            taken[name] = value
        if name in LISTS and rule in (ANY, WITHOUT_IMAGE):
            rules.append((name, _largest(engine, base, name)))
    return tuple(rules)


def _companion(engine: Engine, base: SamplingParams, name: str, value: Any, taken: dict[str, Any]) -> str | None:
    """ "with F" when `name` is refused alone but taken beside a field F that is taken alone (skip-layer guidance's
    scale beside the layers it skips); None when no such field takes it."""
    for other, probe in taken.items():
        if _takes(engine, replace(base, **{other: probe, name: value}), name):
            return f"with {other}"
    return None


def _largest(engine: Engine, base: SamplingParams, name: str, bound: int = 1000) -> int:
    """The largest single item a list field takes (its items are block indices: 0 is taken, `bound` the type's)."""
    low, high = 0, bound
    while low < high:
        middle = (low + high + 1) // 2
        if _takes(engine, replace(base, **{name: (middle,)}), name):
            low = middle
        else:
            high = middle - 1
    return low
