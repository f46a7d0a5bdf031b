"""HTTP bodies (msgspec Structs, decoded and validated at the edge) and OpenAI-shaped errors."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from aiohttp import web

MAX_N = 10
MAX_PARTIAL_IMAGES = 3
OUTPUT_FORMATS = ("png", "jpeg", "webp")
T = TypeVar("T")
QUALITIES = ("auto", "low", "medium", "high", "standard", "hd")


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers, dumps=_dumps)


def _dumps(obj) -> str:
    return msgspec.json.encode(obj).decode()


class ImageGenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI `POST /v1/images/generations`, plus our extensions (last four fields)."""

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    output_compression: int | None = None
    quality: str | None = None
    background: str | None = None
    moderation: str | None = None
    style: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    stream: bool | None = None
    partial_images: int | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None


class GenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Native `POST /v1/generations`: an SSE stream of everything the engine knows about one request."""

    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    preview_every: int = 0
    # Also stream the raw latent (base64, with dtype and shape) with each preview.
    latents: bool = False
    output_format: str = "png"


_PARAM_PATTERNS = (
    re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)"),
    re.compile(r"unknown field `([^`]+)`"),
    re.compile(r"missing required field `([^`]+)`"),
)


def decode_body(data: bytes, type_: type[T]) -> T:
    """Decode a JSON body into `type_`, or raise a 400 ApiError naming the offending field."""
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = next((m.group(1) for p in _PARAM_PATTERNS if (m := p.search(message))), None)
        raise ApiError(400, f"invalid request: {message}", param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


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


def validate_openai(req: ImageGenerationRequest) -> None:
    """The OpenAI fields we check ourselves; size, steps and guidance limits come from the model adapter."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}; got {req.n}", param="n")
    if req.response_format == "url":
        raise ApiError(
            400,
            "response_format 'url' is not supported: diffusiond does not host images; use 'b64_json'",
            param="response_format",
        )
    check_choice("response_format", req.response_format, ("b64_json",))
    check_choice("output_format", req.output_format, OUTPUT_FORMATS)
    check_choice("quality", req.quality, QUALITIES)
    check_choice("moderation", req.moderation, ("auto", "low"))
    check_choice("style", req.style, ("vivid", "natural"))
    if req.background == "transparent":
        raise ApiError(400, "background 'transparent' is not supported by diffusion models here", param="background")
    check_choice("background", req.background, ("auto", "opaque"))
    if req.output_compression is not None:
        if not 0 <= req.output_compression <= 100:
            raise ApiError(
                400,
                f"output_compression must be between 0 and 100; got {req.output_compression}",
                param="output_compression",
            )
        if (req.output_format or "png") == "png":
            raise ApiError(400, "output_compression applies to jpeg and webp only", param="output_compression")
    if req.partial_images is not None:
        if not 0 <= req.partial_images <= MAX_PARTIAL_IMAGES:
            raise ApiError(
                400,
                f"partial_images must be between 0 and {MAX_PARTIAL_IMAGES}; got {req.partial_images}",
                param="partial_images",
            )
        if req.partial_images and not req.stream:
            raise ApiError(400, "partial_images needs stream=true", param="partial_images")
