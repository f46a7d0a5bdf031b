"""The OpenAPI document of the model loaded: the code's (daemon/openapi.py `document`) with the routes of other kinds
of model left out, the server's limits as bounds, and the fields the model takes as its own rules say
(daemon/field_rules.py): what a client generated from it is told is what the daemon takes."""

from __future__ import annotations

import math

from diffusiond.daemon.config import MAX_N
from diffusiond.daemon.field_rules import NEVER, REQUIRED, WITHOUT_IMAGE, largest_square
from diffusiond.daemon.openapi import FORMS, OPAQUE_BACKGROUNDS, document, form_schema, options, words_schema
from diffusiond.daemon.video_requests import DEFAULT_SECONDS
from diffusiond.models.base import Capabilities
from diffusiond.models.params import MAX_FRAMES, RequestLimits

# The routes of one kind of model, by path prefix: a model of another kind answers them 400 naming the route to use
# (daemon/openai_api.py `refuse_non_images`, videos_api.py `check_job_model`), so the document of a loaded model leaves
# them out.
KIND_ROUTES = {"image": "/v1/images/", "video": "/v1/videos", "audio": "/v1/audio/"}


def served_document(
    caps: Capabilities | None,
    limits: RequestLimits | None,
    max_n: int = MAX_N,
    lora_dir: bool = False,
    rules: tuple[tuple[str, str | int], ...] = (),
    lora_names: tuple[str, ...] | None = None,
) -> dict:
    """The document of the model loaded (None before it is loaded: every route, the code's bounds): the routes of
    the other kinds of model left out, and the LoRA routes of a model without LoRA (`POST /v1/loras` without
    `--lora-dir`: adapters cannot be added); the server's limits on sizes, steps and images a request, as bounds a
    client can check: sides at most the square that fits `--max-pixels`, multiples of the model's size multiple (what
    is refused beyond it, a wide image within the pixel budget, is understated, never promised), and the size
    required when the model's default does not fit; the fields the model takes as its own rules say (`rules`, from
    daemon/field_rules.py) and the LoRA adapters registered now (`lora_names`)."""
    doc = document()
    if caps is None or limits is None:
        return doc
    narrow(doc, rules, lora_names if caps.lora else None)
    if caps.mode == "generic":  # what a request may add to the pipeline's call: the names its signature settles
        _call_names(doc["components"]["schemas"]["GenerationRequest"]["properties"], caps.fields)
    elif caps.call_arguments:  # a dedicated family's own call switches, on the native and the OpenAI routes
        for name in ("GenerationRequest", "ImageGenerationRequest", "ImageEditRequest"):
            props = doc["components"]["schemas"].get(name, {}).get("properties", {})
            if "arguments" in props:
                _call_names(props, caps.call_arguments, ("arguments",))
    dropped = tuple(prefix for kind, prefix in KIND_ROUTES.items() if kind != caps.modality)
    if not caps.lora:
        dropped += ("/v1/loras",)
    dropped += unserved_routes(rules)
    doc["paths"] = {path: item for path, item in doc["paths"].items() if not path.startswith(dropped)}
    if caps.lora and not lora_dir:
        doc["paths"]["/v1/loras"].pop("post")
    m = caps.size_multiple
    side = largest_square(caps, limits.max_pixels)
    fits = caps.default_width * caps.default_height <= limits.max_pixels
    sizes = [f"{s}x{s}" for s in range(m, side + 1, m)]
    schemas = doc["components"]["schemas"]
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        if "num_inference_steps" in props:
            props["num_inference_steps"] = _bounded(props["num_inference_steps"], maximum=limits.max_steps)
        if "n" in props and name.startswith("Image"):
            props["n"] = _bounded(props["n"], maximum=max_n)
        if "size" in props and name.startswith(("Image", "Video")):
            props["size"] = {"type": "string", "enum": (["auto"] if fits else []) + sizes}
            if not fits:
                schema.setdefault("required", []).append("size")
        if "background" in props and not caps.alpha:  # transparent is refused where images have no alpha
            props["background"] = words_schema(OPAQUE_BACKGROUNDS, nullable=True)
        if name == "GenerationRequest":
            for key, kind in (("video_format", "video"), ("audio_format", "audio")):  # the model's kind of output
                if caps.modality != kind:
                    props[key] = {"type": "null", "description": f"for {kind} models"}
            for key in ("width", "height"):
                props[key] = {"type": "integer", "minimum": m, "maximum": side, "multipleOf": m}
            if not fits:
                schema.setdefault("required", []).extend(["width", "height"])
        if "num_frames" in props and caps.modality == "video" and caps.frame_step and limits.max_frames:
            # Clips of 1 + frame_step * k frames, up to the model's most and --max-frames; required (not null)
            # where the model's default clip is longer than the limit.
            most = min(limits.max_frames, caps.max_num_frames or limits.max_frames)
            frames = {"type": "integer", "enum": list(range(1, most + 1, caps.frame_step))}
            if caps.default_num_frames is not None and caps.default_num_frames > most:
                props["num_frames"] = frames
                schema.setdefault("required", []).append("num_frames")
            else:
                props["num_frames"] = {"anyOf": [frames, {"type": "null"}]}
        if name == "VideoCreateRequest" and caps.modality == "video" and caps.frame_step and caps.default_fps:
            _video_seconds(schema, caps, limits)
        if "num_inference_steps" in props and caps.default_steps > limits.max_steps:
            # Its default is above the limit: a number is required (null would mean the default).
            schema.setdefault("required", []).append("num_inference_steps")
            steps = props["num_inference_steps"]
            (props["num_inference_steps"],) = [s for s in options(steps) if s.get("type") == "integer"]
    # The forms, from the JSON schemas as narrowed above; the files the model does not take, none.
    untaken = {name for name, rule in rules if rule == NEVER}
    if "image" in untaken:  # under each schema's own name for it
        untaken |= {field for field in IMAGE_FIELD.values() if field}
    for path in FORMS:
        item = doc["paths"].get(path)
        if item is not None:
            form = form_schema(schemas, path, lora_names if caps.lora else (), frozenset(untaken))
            item["post"]["requestBody"]["content"]["multipart/form-data"]["schema"] = form
    return doc


def _video_seconds(schema: dict, caps: Capabilities, limits: RequestLimits) -> None:
    """OpenAI's `seconds` on a video model (daemon/video_requests.py `frames_for`): the clip that plays that long
    at the model's fps must fit the longest it makes under --max-frames (half a frame short of it, against float
    rounding); seconds or num_frames, not both; where OpenAI's default length (or the model's own) does not fit,
    one of them required. Understated: with a chosen `fps`, no `seconds` (the bound would be their product)."""
    props = schema["properties"]
    fps, step = caps.default_fps, caps.frame_step
    longest = 1 + step * ((min(limits.max_frames or MAX_FRAMES, caps.max_num_frames or MAX_FRAMES) - 1) // step)
    most = (longest - 0.5) / fps
    options: list[dict] = [{"type": "number", "exclusiveMinimum": 0, "maximum": most}]
    whole = [str(n) for n in range(1, int(most) + 1)]
    if whole:
        options.append({"type": "string", "enum": whole})
    props["seconds"] = {"anyOf": [*options, {"type": "null"}], "description": f"at most {most:.3g} s at {fps} fps"}
    rules = schema.setdefault("allOf", [])
    rules.append({"if": _present("seconds"), "then": _absent("num_frames")})
    rules.append({"if": _present("fps"), "then": _absent("seconds")})
    if math.ceil(DEFAULT_SECONDS * fps - 1e-9) > longest:  # the default length's clip (or more) does not fit
        rules.append({"anyOf": [_present("seconds"), _present("num_frames")]})


def _bounded(schema: dict, maximum: int) -> dict:
    """An integer (or null) field's schema with a lower `maximum`."""
    if "anyOf" in schema:
        return {"anyOf": [_bounded(s, maximum) if s.get("type") == "integer" else s for s in schema["anyOf"]]}
    return {**schema, "maximum": min(schema.get("maximum", maximum), maximum)}


# The request schemas a model's rules narrow, and the field that carries each one's input image (None: it has none,
# the OpenAI generation; "" it always has one, the OpenAI edit).
IMAGE_FIELD = {
    "ImageGenerationRequest": None,
    "ImageEditRequest": "",
    "GenerationRequest": "image",
    "VideoCreateRequest": "input_reference",
    "AudioCreateRequest": None,
}
PRESENT = {"not": {"type": "null"}}


def _present(name: str) -> dict:
    return {"properties": {name: PRESENT}, "required": [name]}


def _absent(name: str) -> dict:
    return {"properties": {name: {"type": "null"}}}


def unserved_routes(rules: tuple[tuple[str, str | int], ...]) -> tuple[str, ...]:
    """The OpenAI image routes the model cannot serve: generations without an image (a model that edits only), or
    edits (a model that takes no input image)."""
    image = dict(rules).get("image")
    return {REQUIRED: ("/v1/images/generations",), NEVER: ("/v1/images/edits",)}.get(image, ())


def narrow(doc: dict, rules: tuple[tuple[str, str | int], ...], lora_names: tuple[str, ...] | None) -> None:
    """The document's request schemas as the loaded model takes them (`field_rules`): a field it never takes is
    null only (the same as leaving it out), one it takes only beside an input image (or only without one), or beside
    another field, is tied to it by an if/then rule, or null only where the schema has no such field (an image
    always there: no rule); a list of block indices has its largest; `lora` names the adapters registered now
    (`lora_names`; None: the model takes none)."""
    schemas = doc["components"]["schemas"]
    image_rule = dict(rules).get("image")
    for schema_name, image in IMAGE_FIELD.items():
        schema = schemas.get(schema_name)
        if schema is None:
            continue
        props = schema["properties"]
        for name, rule in rules:
            if name not in props or name == image:
                continue
            if isinstance(rule, int):
                _bound_items(props, name, rule)
                continue
            # "with F": taken only beside F (WITH_IMAGE is "with image"), which is this schema's image field
            companion = rule.removeprefix("with ") if rule.startswith("with ") else None
            other = image if companion == "image" else companion
            never = (
                rule == NEVER
                or (companion is not None and other is None)
                or (companion is not None and other != "" and other not in props)
                or (rule == WITHOUT_IMAGE and image == "")
            )
            if never:
                props[name] = {"type": "null", "description": f"not taken by this model ({rule})"}
            elif companion is not None and other:
                schema.setdefault("allOf", []).append({"if": _present(name), "then": _present(other)})
            elif rule == WITHOUT_IMAGE and image:
                schema.setdefault("allOf", []).append({"if": _present(image), "then": _absent(name)})
        if image and image_rule == NEVER:
            props[image] = {"type": "null", "description": "this model takes no input image"}
        elif image and image_rule == REQUIRED:
            props[image] = {k: v for k, v in props[image].items() if k != "default"}
            if "anyOf" in props[image]:
                props[image]["anyOf"] = [o for o in props[image]["anyOf"] if o.get("type") != "null"]
            schema.setdefault("required", []).append(image)
        if "lora" in props:
            props["lora"] = _loras(props["lora"], lora_names)


def _call_names(props: dict, names: tuple[str, ...], fields: tuple[str, ...] = ("arguments", "images")) -> None:
    """The generic path's `arguments` and `images` (or a dedicated family's `arguments`) keyed only by the call's
    settable parameters."""
    for field in fields:
        for option in options(props[field]):
            if option.get("type") == "object":
                option["propertyNames"] = {"enum": list(names)}


def _bound_items(props: dict, name: str, largest: int) -> None:
    for option in options(props[name]):
        if option.get("type") == "array":
            option["items"] = {**option["items"], "maximum": largest}


def _loras(schema: dict, names: tuple[str, ...] | None) -> dict:
    """`lora` naming only registered adapters (none registered, or a model without LoRA: null or empty only)."""
    if not names:
        return {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}], "description": "no adapter registered"}
    return {"anyOf": [_named(option, names) for option in options(schema)]}


def _named(option: dict, names: tuple[str, ...]) -> dict:
    if option.get("type") != "array":
        return option
    return {**option, "items": {"allOf": [option["items"], {"properties": {"name": {"enum": list(names)}}}]}}
