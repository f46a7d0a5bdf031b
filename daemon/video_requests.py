"""The body of `POST /v1/videos` and the request it becomes: multipart (OpenAI's clients) or JSON, its
`input_reference` image, and `seconds` turned into frames at the request's fps (the model's by default): the
shortest clip of the family's form (1 + frame_step * k frames) that plays for at least that long, refused when it
has more frames than the model makes."""

from __future__ import annotations

import base64
import binascii
import math
import re

import msgspec
from aiohttp import web

from diffusiond.daemon.api import (
    ApiError,
    InputReference,
    Layers,
    Loras,
    VideoCreateRequest,
    body_limit,
    convert_fields,
    decode_body,
    json_fields,
    parse_size,
)
from diffusiond.daemon.edge import read_body, read_form
from diffusiond.daemon.state import STATE
from diffusiond.engine.engine import Engine
from diffusiond.models.base import Capabilities
from diffusiond.models.params import MAX_FRAMES, ParamError, SamplingParams, params_from

MAX_SECONDS = 3600.0


async def read_video_create(request: web.Request) -> tuple[VideoCreateRequest, bytes | None]:
    """The body of `POST /v1/videos`, multipart (OpenAI's clients) or JSON, and its input_reference image, if any,
    unchecked (ApiError)."""
    config = request.app[STATE].config
    reference = None
    if request.content_type == "multipart/form-data":
        fields, files = await read_form(request, {"input_reference": 1}, config.max_image_bytes)
        nested = {k[len("input_reference[") : -1]: fields.pop(k) for k in list(fields) if _NESTED.fullmatch(k)}
        form = json_fields(fields, {"lora": Loras, "stg_blocks": Layers})
        if nested:
            form["input_reference"] = nested
        body = convert_fields(form, VideoCreateRequest)
        if files["input_reference"]:
            if body.input_reference is not None:
                raise ApiError(400, "input_reference is sent twice", param="input_reference")
            reference = files["input_reference"][0]
    else:  # JSON (edge.check_content_type refused anything else)
        limit = body_limit(config.max_body_bytes, config.max_image_bytes)
        return parse_video_create(await read_body(request, limit))
    if body.input_reference is not None:
        reference = _reference_image(body.input_reference)
    return body, reference


def parse_video_create(data: bytes) -> tuple[VideoCreateRequest, bytes | None]:
    """A JSON body of `POST /v1/videos`, and its input_reference image (a data URL), if any, unchecked (ApiError)."""
    body = decode_body(data, VideoCreateRequest)
    return body, None if body.input_reference is None else _reference_image(body.input_reference)


_NESTED = re.compile(r"input_reference\[\w+\]")
_DATA_URL = re.compile(r"data:[\w.+-]+/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,(.*)", re.DOTALL)


def _reference_image(ref: InputReference) -> bytes:
    if ref.file_id is not None:
        raise ApiError(
            400, "diffusiond keeps no files: send input_reference as a file, or as a data URL", param="input_reference"
        )
    match = _DATA_URL.fullmatch(ref.image_url or "")
    if match is None:
        raise ApiError(
            400,
            "input_reference.image_url must be a base64 data URL (data:image/png;base64,...); diffusiond fetches no "
            "URLs",
            param="input_reference",
        )
    try:
        return base64.b64decode(match.group(1), validate=True)
    except binascii.Error:
        raise ApiError(400, "input_reference.image_url is not valid base64", param="input_reference") from None


def resolve_video(engine: Engine, body: VideoCreateRequest, reference: bytes | None) -> SamplingParams:
    """The request the job runs, checked against the model, the limits and the wire; errors name the fields the
    client sent (`size`, not width; `seconds` when it chose the frames; `input_reference`, not image)."""
    width, height = parse_size(body.size)
    seconds = parse_seconds(body.seconds)
    if seconds is not None and body.num_frames is not None:
        raise ApiError(400, "send seconds or num_frames, not both", param="seconds")
    caps = engine.adapter.capabilities
    computed: dict = {"width": width, "height": height, "image": reference}
    renames = {"width": "size", "height": "size", "image": "input_reference"}
    fps = body.fps or caps.default_fps  # the model's default unless the client chose one
    if seconds is not None:
        assert fps is not None
        computed["num_frames"] = frames_for(seconds, fps, caps)
        renames["num_frames"] = "seconds"
    elif body.num_frames is None and (frames := default_frames(fps, caps)) is not None:
        computed["num_frames"] = frames  # OpenAI's default length, where the model makes it
    params = params_from(msgspec.structs.asdict(body), **computed)
    try:
        return engine.check(params)
    except ParamError as exc:
        if exc.param in renames:
            raise ParamError(renames[exc.param], str(exc)) from None
        raise


# OpenAI's Videos API: a request without `seconds` is this long.
DEFAULT_SECONDS = 4.0


def default_frames(fps: int | None, caps: Capabilities) -> int | None:
    """The frames of OpenAI's default length at `fps`, or None where the model makes no clip that long (its own
    default length then)."""
    if fps is None:
        return None
    try:
        return frames_for(DEFAULT_SECONDS, fps, caps)
    except ApiError:
        return None


def reported_seconds(body: VideoCreateRequest, resolved: SamplingParams, caps: Capabilities) -> str:
    """A job's `seconds`: what the request asked (OpenAI's default where it sent neither seconds nor frames and the
    model made that length), its frames rounded up to the family's form beside it; else the clip's own length."""
    assert resolved.num_frames is not None and resolved.fps is not None
    if body.seconds is not None:
        return f"{parse_seconds(body.seconds):g}"
    if body.num_frames is None and resolved.num_frames == default_frames(resolved.fps, caps):
        return f"{DEFAULT_SECONDS:g}"
    return f"{resolved.num_frames / resolved.fps:g}"


def parse_seconds(value: str | float | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_SECONDS:  # NaN too
        raise ApiError(
            400, f"seconds must be a number above 0 and at most {MAX_SECONDS:g}; got {value!r}", param="seconds"
        )
    return seconds


def frames_for(seconds: float, fps: int, caps: Capabilities) -> int:
    """The shortest clip of the family's form (1 + frame_step * k frames) that plays for at least `seconds` at
    `fps` (N frames play for N / fps seconds). ApiError naming `seconds` when the model makes no clip that long."""
    step = caps.frame_step or 1
    wanted = max(1, math.ceil(seconds * fps - 1e-9))
    frames = 1 + step * math.ceil((wanted - 1) / step)
    most = min(caps.max_num_frames or MAX_FRAMES, MAX_FRAMES)
    if frames > most:
        longest = 1 + step * ((most - 1) // step)
        raise ApiError(
            400,
            f"seconds {seconds:g} at {fps} fps is {frames} frames; this model makes at most {longest} "
            f"({longest / fps:g} s at {fps} fps): ask for fewer seconds, or a lower fps",
            param="seconds",
        )
    return frames
