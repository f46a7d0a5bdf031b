"""HTTP bodies (msgspec Structs, decoded and validated at the edge) and OpenAI-shaped errors."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from aiohttp import web

from diffusiond.daemon.config import MAX_N
from diffusiond.models.params import (
    MAX_IMAGE_BYTES,
    Argument,
    ArgumentName,
    CacheSteps,
    CacheThreshold,
    EditContext,
    Fps,
    Fraction,
    Frames,
    Guidance,
    Layers,
    Loras,
    PreviewMode,
    Prompt,
    RequestFields,
    Seed,
    Steps,
)

MAX_PARTIAL_IMAGES = 3
# Every number a client sends is bounded here, at the edge, with the field named in the error: nothing unbounded may
# reach the wire (msgpack holds 64-bit integers only) or the model.
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
PartialImages = Annotated[int, msgspec.Meta(ge=0, le=MAX_PARTIAL_IMAGES)]
Compression = Annotated[int, msgspec.Meta(ge=0, le=100)]
Short = Annotated[str, msgspec.Meta(max_length=256)]
OUTPUT_FORMATS = ("png", "jpeg", "webp")
# The OpenAI image fields that take one of a few words (`validate_openai`; the OpenAPI document lists them).
CHOICES: dict[str, tuple[str, ...]] = {
    "response_format": ("b64_json", "url"),
    "output_format": OUTPUT_FORMATS,
    "moderation": ("auto", "low"),
    "background": ("auto", "opaque", "transparent"),
}
# OpenAI fields always refused, naming them (DALL-E 3's style; input_fidelity: `strength` says it here).
REFUSED_FIELDS = ("style", "input_fidelity")
T = TypeVar("T")


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        # Close the connection after the answer (a body left unread is not worth reading).
        self.close = close
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers, dumps=_dumps)
        if self.close:
            response.force_close()
        return response


def _dumps(obj) -> str:
    return msgspec.json.encode(obj).decode()


# A request's class (engine/scheduler.py MAX_PRIORITY).
Priority = Annotated[int, msgspec.Meta(ge=0, le=9)]
# Milliseconds its client waits for it (engine/deadlines.py), at most a day.
DeadlineMs = Annotated[int, msgspec.Meta(ge=1, le=86_400_000)]


# Arguments of the pipeline's call by name: the generic path's (`fields` at /v1/models), or a dedicated family's own
# switches (`arguments` there).
Arguments = Annotated[dict[ArgumentName, Argument], msgspec.Meta(max_length=32)]


class ImageGenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI `POST /v1/images/generations`, plus our extensions (from `negative_prompt` on)."""

    prompt: Prompt
    model: Short | None = None
    n: N | None = None
    size: Short | None = None
    response_format: Short | None = None
    output_format: Short | None = None
    output_compression: Compression | None = None
    quality: Short | None = None
    background: Short | None = None
    moderation: Short | None = None
    style: Short | None = None
    user: Short | None = None
    safety_identifier: Short | None = None
    stream: bool | None = None
    partial_images: PartialImages | None = None
    negative_prompt: Prompt | None = None
    seed: Seed | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    # Every per-request field of the native API (models/params.py), here too: OpenAI clients send them as extra body.
    true_cfg_scale: Guidance | None = None
    skip_guidance_layers: Layers | None = None
    skip_layer_guidance_scale: Guidance | None = None
    skip_layer_guidance_start: Fraction | None = None
    skip_layer_guidance_stop: Fraction | None = None
    # How partial images are made: "fast" (latent -> RGB, scaled up) or "vae" (a real decode, full resolution).
    preview: PreviewMode = "fast"
    # Step caching threshold for this request (servers started with --cache); 0: exact.
    cache_threshold: CacheThreshold | None = None
    # The steps that always compute (SCM): "fast", "medium", "slow", "off" or step indices.
    cache_steps: CacheSteps | None = None
    # LoRA adapters for this request: [{"name": "style", "scale": 0.8}] (multipart edits: the same, as a JSON string).
    lora: Loras | None = None
    # A family's own call switches by name (/v1/models `arguments`: Qwen-Image-Layered's `layers`), as on the native
    # API (multipart edits: a JSON object string).
    arguments: Arguments | None = None
    # Its class, 0-9, higher served first (engine/scheduler.py); default --default-priority.
    priority: Priority | None = None
    # Milliseconds its client waits: refused (429) when the engine's estimate is later; earlier deadlines first.
    deadline_ms: DeadlineMs | None = None


class ImageEditRequest(ImageGenerationRequest, kw_only=True):
    """The text fields of OpenAI `POST /v1/images/edits` (multipart; the files are read apart), plus `strength`:
    how much of the schedule the edit runs, from the input image (0: none of it, 1: all)."""

    input_fidelity: Short | None = None
    strength: Fraction | None = None
    # Instruction edits (FLUX.1 Kontext): "preferred" (the pipeline's ~1 Mpx context, default) or "output" (scaled to
    # the output's area: cheaper below 1 Mpx, not the pipeline's image).
    edit_context: EditContext | None = None


VideoFormat = Literal["mp4", "webp"]
# A base64 data URL of an image file (input_reference in JSON bodies): what base64 makes of the largest file, and more.
DataUrl = Annotated[str, msgspec.Meta(max_length=4 * MAX_IMAGE_BYTES // 3 + 1024)]


class InputReference(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `input_reference` object (JSON bodies): an image as a data URL; files by id are not kept here."""

    image_url: DataUrl | None = None
    file_id: Short | None = None


class VideoCreateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI `POST /v1/videos` (multipart, as OpenAI's clients send it, or JSON), plus our extensions (from
    `negative_prompt` on). `seconds`: a string as OpenAI's, or a number; `input_reference` arrives as a file part in
    multipart bodies."""

    prompt: Prompt
    model: Short | None = None
    seconds: Short | float | None = None
    size: Short | None = None
    input_reference: InputReference | None = None
    user: Short | None = None
    negative_prompt: Prompt | None = None
    seed: Seed | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    # Two-expert checkpoints (Wan 2.2 A14B): the low-noise expert's guidance.
    guidance_scale_2: Guidance | None = None
    true_cfg_scale: Guidance | None = None
    cache_threshold: CacheThreshold | None = None
    cache_steps: CacheSteps | None = None
    # Audio-video guidance (LTX-2; models/params.py): the audio's CFG, STG and modality guidance, and rescales.
    audio_guidance_scale: Guidance | None = None
    stg_scale: Guidance | None = None
    audio_stg_scale: Guidance | None = None
    modality_scale: Guidance | None = None
    audio_modality_scale: Guidance | None = None
    guidance_rescale: Fraction | None = None
    audio_guidance_rescale: Fraction | None = None
    # Multipart bodies: as a JSON list.
    stg_blocks: Layers | None = None
    num_frames: Frames | None = None
    fps: Fps | None = None
    # LoRA adapters for this request (multipart bodies: as a JSON string), for families that serve them.
    lora: Loras | None = None
    # The job's class, 0-9, higher served first (engine/scheduler.py); default --default-priority.
    priority: Priority | None = None
    # Milliseconds within which the clip must be done: refused (429) at once when the engine's estimate is later;
    # earlier deadlines first within a class. Its admission only: a job run again (a restart, another replica's
    # claim) runs without it.
    deadline_ms: DeadlineMs | None = None


class AudioCreateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/audio/generations` (JSON): what the call takes, as on the native API, and the file's format."""

    prompt: Prompt
    model: Short | None = None
    user: Short | None = None
    # The call's length argument (daemon/audio_jobs.py LENGTH_ARGUMENTS), at most an hour.
    seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] | None = None
    negative_prompt: Prompt | None = None
    seed: Seed | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    # Further arguments of the pipeline's call by name (/v1/models lists them as `fields`).
    arguments: Arguments | None = None
    format: Literal["wav", "flac"] = "wav"
    # The job's class, 0-9, higher served first (engine/scheduler.py); default --default-priority.
    priority: Priority | None = None
    # Milliseconds within which the sound must be done: refused (429) at once when the engine's estimate is later.
    deadline_ms: DeadlineMs | None = None


class GenerationRequest(RequestFields, frozen=True, forbid_unknown_fields=True):
    """Native `POST /v1/generations`: an SSE stream of everything the engine knows about one request. Its fields are
    what a request can ask for (models/params.py `RequestFields`, with their bounds), and how the answer is encoded."""

    # Also stream the raw latent (base64, with dtype and shape) with each preview.
    stream_latents: bool = msgspec.field(default=False, name="latents")
    output_format: Short = "png"
    # Video models: the file's format ("mp4", H.264; "webp", lossless animated WebP: the exact frames).
    video_format: VideoFormat | None = None
    # Sound models (Stable Audio Open, the generic path's audio pipelines): the file's format ("wav", 16-bit PCM;
    # "flac", lossless).
    audio_format: Literal["wav", "flac"] | None = None
    # The completed event's file: in base64 inside it, or kept here and named by a signed, expiring URL
    # (daemon/files.py).
    response_format: Literal["b64_json", "url"] = "b64_json"
    # Its class, 0-9, higher served first (engine/scheduler.py); default --default-priority.
    priority: Priority | None = None
    # Milliseconds its client waits: refused (429) when the engine's estimate is later; earlier deadlines first.
    deadline_ms: DeadlineMs | None = None


_PARAM_PATTERNS = (
    re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)"),
    re.compile(r"unknown field `([^`]+)`"),
    re.compile(r"missing required field `([^`]+)`"),
)


def decode_body(data: bytes, type_: type[T]) -> T:
    """Decode a JSON body into `type_`, or raise a 400 ApiError naming the offending field. An integer field sent as a
    number with no fraction (`2.0`: an integer to JSON Schema, and what Python's json writes for a float) is taken
    as that integer; strings are never numbers here (decoding stays strict)."""
    for _ in range(MAX_INTEGRAL_FIXES + 1):
        try:
            return msgspec.json.decode(data, type=type_)
        except msgspec.ValidationError as exc:
            fixed = _integral_floats(data, str(exc))
            if fixed is None:
                raise _invalid(exc) from None
            data = fixed
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    raise ApiError(400, "invalid request: too many integers written as floats", code="invalid_value")


# Integer fields a body may write as integral floats (each is one more decode of the body).
MAX_INTEGRAL_FIXES = 16
_INTEGRAL = re.compile(r"^Expected `(?:[^`]* \| )?int(?: \| [^`]*)?`, got `float` - at `\$(.*)`$")
_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+|\.\.\.)\]")


def _integral_floats(data: bytes, error: str) -> bytes | None:
    """`data` with the float at the path msgspec's "Expected `int`, got `float`" names made an int, where it has no
    fraction (all of a map's values at `[...]`, a key msgspec does not name; all of a list's items at `[i]`, so that
    a list of 64 such floats is one fix, not 64); None when there is none to fix."""
    match = _INTEGRAL.match(error)
    if match is None:
        return None
    try:
        root: Any = msgspec.json.decode(data)
    except msgspec.DecodeError:  # not JSON after the field that failed (decoding stopped there): no fix
        return None
    parents: list[tuple[Any, Any]] = [({"": root}, "")]
    for name, index in _SEGMENT.findall(match.group(1)):
        nodes, parents = parents, []
        for container, key in nodes:
            value = container[key]
            if name and isinstance(value, dict) and name in value:
                parents.append((value, name))
            elif index == "..." and isinstance(value, dict):
                parents.extend((value, k) for k in value)
            elif index.isdigit() and isinstance(value, list):  # every item: a list of integers is fixed at once
                parents.extend((value, i) for i in range(len(value)))
    changed = False
    for container, key in parents:
        value = container[key]
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            container[key], changed = int(value), True
    return msgspec.json.encode(root) if changed else None


def convert_fields(fields: dict[str, str], type_: type[T]) -> T:
    """Form fields (strings) into `type_`, numbers and booleans parsed, or a 400 ApiError naming the field."""
    try:
        return msgspec.convert(fields, type_, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


# What a form's JSON field looks like, for the errors that name it.
EXAMPLES = {"lora": '[{"name": "style", "scale": 0.8}]', "arguments": '{"layers": 4}'}


def json_fields(fields: dict[str, str], types: dict[str, Any]) -> dict[str, Any]:
    """Form fields, with those named in `types` decoded from the JSON text a form carries them as (a list of
    objects, as `lora`), or a 400 ApiError naming the field."""
    out: dict[str, Any] = dict(fields)
    for name, type_ in types.items():
        example = EXAMPLES.get(name, "{}")
        if any(key.startswith(f"{name}[") for key in out):  # a client that flattens objects into form fields
            raise ApiError(400, f"{name} in a form is one field of JSON text, such as {example}", param=name)
        if name not in out:
            continue
        try:
            out[name] = msgspec.to_builtins(msgspec.json.decode(out[name], type=type_))
        except msgspec.ValidationError as exc:
            raise ApiError(400, f"invalid request: {exc} (in {name})", param=name, code="invalid_value") from None
        except msgspec.DecodeError:
            raise ApiError(400, f"{name} in a form is JSON text, such as {example}", param=name) from None
    # A preset's name, or JSON text of a list: cache_steps "fast" or "[0, 3, 9]".
    steps = out.get("cache_steps")
    if isinstance(steps, str) and steps.lstrip().startswith("["):
        try:
            out["cache_steps"] = msgspec.to_builtins(msgspec.json.decode(steps, type=CacheSteps))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message = f"cache_steps in a form is a preset or JSON text of step indices, such as [0, 3, 9] ({exc})"
            raise ApiError(400, message, param="cache_steps", code="invalid_value") from None
    return out


def _invalid(exc: msgspec.ValidationError) -> ApiError:
    message = str(exc)
    param = next((m.group(1) for p in _PARAM_PATTERNS if (m := p.search(message))), None)
    return ApiError(400, f"invalid request: {message}", param=param, code="invalid_value")


def base64_size(size: int) -> int:
    return 4 * -(-size // 3)


def body_limit(max_body_bytes: int, max_image_bytes: int) -> int:
    """The largest JSON body of a route whose images (at most `max_image_bytes` together) come in base64."""
    return max_body_bytes + base64_size(max_image_bytes)


def retry_later(message: str, code: str, *, status: int = 503, after: int = 1, close: bool = False) -> ApiError:
    """An error to send again after `after` seconds (Retry-After): 429 for a full queue (OpenAI's rate_limit_error),
    503 for a server that is busy, loading or restarting."""
    kind = "rate_limit_error" if status == 429 else "server_error"
    return ApiError(status, message, type=kind, code=code, headers={"Retry-After": str(after)}, close=close)


class NotStarted(ApiError):
    """A request the server took and never started: its group failed first (503, send it again). Under the launcher
    the next rank 0 serves it instead (daemon/handover.py)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, type="server_error", code="engine_restarting", headers={"Retry-After": "1"})


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than {limit} bytes, this route's limit (--max-body-bytes; routes that take an image "
        "add --max-image-bytes)",
        code="request_too_large",
        close=True,
    )


def check_choice(name: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise ApiError(400, f"{name} must be one of {', '.join(choices)}; got {value!r}", param=name)


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size is None or size == "auto":
        return None, None
    match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size)
    if not match:
        raise ApiError(400, f"size must be 'auto' or 'WIDTHxHEIGHT' such as '256x256'; got {size!r}", param="size")
    return int(match.group(1)), int(match.group(2))


def validate_openai(req: ImageGenerationRequest, max_n: int = MAX_N) -> None:
    """The OpenAI fields we check ourselves; size, steps and guidance limits come from the model adapter."""
    if req.n is not None and req.n > max_n:
        raise ApiError(400, f"n is {req.n}; this server allows at most {max_n} images per request (--max-n)", param="n")
    check_choice("response_format", req.response_format, CHOICES["response_format"])
    if req.response_format == "url" and req.stream:
        raise ApiError(
            400,
            "a streamed answer carries its images in b64_json; response_format 'url' is for "
            "answers that are not streamed",
            param="response_format",
        )
    check_choice("output_format", req.output_format, CHOICES["output_format"])
    # Accepted without effect (docs/http-api.md): nothing here moderates, so both levels are what is served.
    check_choice("moderation", req.moderation, CHOICES["moderation"])
    if req.style is not None:
        raise ApiError(
            400,
            "style is DALL-E 3's (vivid, natural); the models served here have no styles: describe the style in the "
            "prompt",
            param="style",
        )
    check_choice("background", req.background, CHOICES["background"])  # what it does: openai_api.py
    # Ranges (n, output_compression, partial_images) are checked by the struct's annotated types.
    if req.output_compression is not None and (req.output_format or "png") == "png":
        raise ApiError(400, "output_compression applies to jpeg and webp only", param="output_compression")
    if req.partial_images and not req.stream:
        raise ApiError(400, "partial_images needs stream=true", param="partial_images")
