"""`GET /openapi.json`: an OpenAPI 3.1 document of every route. Request bodies' schemas come from the msgspec Structs
the routes decode (`msgspec.json.schema_components`), so the document cannot drift from what is accepted; responses
are the shapes the routes write, errors always OpenAI's. `tests/daemon/test_openapi.py` runs schemathesis against
it: no 5xx, no status, content type or body outside what is documented here."""

from __future__ import annotations

from typing import Any

import msgspec

from diffusiond import __version__
from diffusiond.daemon.api import (
    CHOICES,
    REFUSED_FIELDS,
    AudioCreateRequest,
    GenerationRequest,
    ImageEditRequest,
    ImageGenerationRequest,
    VideoCreateRequest,
)
from diffusiond.daemon.loras_api import LoraCreateRequest

REF = "#/components/schemas/{name}"
JSON = "application/json"
SSE = "text/event-stream"
# What any route may answer besides its own: a bad body or Host, a browser's request from elsewhere, a key, the
# edge's budgets (daemon/edge.py, daemon/connections.py), not ready yet.
COMMON_ERRORS = {
    "400": "invalid request (`param` names the field)",
    "401": "missing or invalid API key (--api-key)",
    "403": "cross-origin request from an origin not in --cors-origins",
    "413": "body larger than the route's limit",
    "415": "body not JSON (or multipart where the route takes a form)",
    "421": "Host not this server's (--allowed-hosts)",
    "429": "too many requests in flight (Retry-After)",
    "503": "not ready, draining, or past the connection or read budget (Retry-After)",
}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict:
    return {
        "type": "object",
        "properties": {**required, **(optional or {})},
        "required": list(required),
        "additionalProperties": True,
    }


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# One event of an SSE stream: its name, its JSON as text, and (native streams, daemon/replay.py) its number.
SSE_EVENT = {
    "type": "object",
    "properties": {"event": STR, "data": {**STR, "contentMediaType": "application/json"}, "id": STR},
    "required": ["event", "data"],
}
NULLABLE_STR = {"type": ["string", "null"]}
ERROR = _obj(
    {
        "error": _obj(
            {"message": STR, "type": STR, "param": NULLABLE_STR, "code": NULLABLE_STR},
        )
    }
)
IMAGES = _obj(
    {"created": INT, "data": {"type": "array", "items": _obj({}, {"b64_json": STR, "url": STR})}},
    {"size": STR, "quality": STR, "background": STR, "output_format": STR, "usage": {"type": "object"}},
)
VIDEO = _obj(
    {"id": STR, "object": {"const": "video"}, "status": STR, "progress": INT, "created_at": INT, "model": STR},
    {"prompt": STR, "seconds": STR, "size": STR, "num_frames": INT, "fps": INT, "seed": INT, "url": STR},
)
AUDIO = _obj(
    {"id": STR, "object": {"const": "audio"}, "status": STR, "progress": INT, "created_at": INT, "model": STR},
    {"prompt": STR, "seconds": STR, "format": STR, "sample_rate": INT, "seed": INT, "url": STR},
)
LORA = _obj({"object": {"const": "lora"}, "name": STR}, {"path": STR, "bytes": INT, "sha256": STR, "resident": BOOL})
RECORD = _obj(
    {"id": STR, "created": INT, "status": STR, "step": INT, "total": INT}, {"error": NULLABLE_STR, "owner": STR}
)


def _list(item: dict) -> dict:
    return _obj({"object": {"const": "list"}, "data": {"type": "array", "items": item}})


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


def _responses(ok: dict[str, dict], *errors: str) -> dict:
    out: dict[str, Any] = dict(ok)
    described = dict(COMMON_ERRORS)
    described.update({code: why for code, why in (e.split(" ", 1) for e in errors)})
    for code, why in sorted(described.items()):
        out[code] = {"description": why, "content": {JSON: {"schema": _ref("Error")}}}
    return out


def _ok(description: str, content: dict[str, dict], status: str = "200") -> dict[str, dict]:
    return {status: {"description": description, "content": {kind: {"schema": s} for kind, s in content.items()}}}


def _body(schema: dict, *, form: dict | None = None) -> dict:
    content = {JSON: {"schema": schema}}
    if form is not None:
        content["multipart/form-data"] = {"schema": form}
    return {"required": True, "content": content}


# A request's prompt: models/params.py `check_prompts` refuses an empty one, or one of spaces only (with a message of
# its own, so the request structs do not check it: the document says it).
# Not only spaces: a character outside both ECMA-262's `\s` (JSON Schema's regex dialect) and the separators
# Python's str.strip() also removes (\x1c-\x1f, \x85): "\x1c" alone matches ECMA's `\S` and strips to nothing.
PROMPT = {"minLength": 1, "pattern": r"[^\s\x1c-\x1f\x85]", "description": "not empty, not only spaces"}


# An input image's file part: its format names what is taken ("image": a PNG, JPEG, WEBP, GIF or BMP file that
# decodes, models/inputs.py `admit_image`), not any bytes; tests/daemon/test_openapi.py generates such files for it.
IMAGE_FILE = {
    "type": "string",
    "format": "image",
    "contentMediaType": "image/*",
    "description": "a PNG, JPEG, WEBP, GIF or BMP file",
}


# A native request's input image: base64 of an image file (format "base64-image": what models/inputs.py
# `admit_image` decodes; tests/daemon/test_openapi.py generates such text for it), not any base64.
BASE64_IMAGE = {"format": "base64-image", "description": "base64 of a PNG, JPEG, WEBP, GIF or BMP file"}


def options(schema: dict) -> list[dict]:
    """A field's alternatives: its `anyOf` (a nullable field: the value's schema and null), or the schema alone."""
    return schema.get("anyOf", [schema])


def _base64_images(props: dict) -> None:
    for name in ("image", "mask", "reference_images"):
        for option in options(props[name]):
            if option.get("type") == "string":
                option.update(BASE64_IMAGE)
            elif option.get("type") == "array":
                option["items"] = {**option["items"], **BASE64_IMAGE}


# The least `strength` the document promises: 0 runs no step (refused, naming it), nor does a strength whose
# product with the steps vanishes beside them in floats (1.4e-45); 1e-6 runs one step of any count allowed. (SDXL
# rounds the kept steps down: there, a strength below 1/steps runs none either, which this bound does not say.)
LEAST_STRENGTH = 1e-6


def _least_strength(props: dict) -> None:
    for option in options(props["strength"]):
        if option.get("type") == "number":
            option["minimum"] = LEAST_STRENGTH


# The output formats `output_compression` applies to; the backgrounds of images without alpha.
COMPRESSED = [f for f in CHOICES["output_format"] if f != "png"]
OPAQUE_BACKGROUNDS = [b for b in CHOICES["background"] if b != "transparent"]


def words_schema(words, *, nullable: bool = False) -> dict:
    """A field that takes one of `words` (or null)."""
    one = {"type": "string", "enum": list(words)}
    return {"anyOf": [one, {"type": "null"}]} if nullable else one


def _openai_words(schema: dict) -> None:
    """An OpenAI image request's schema says what `validate_openai` takes: the fields of a few words list them, the
    fields always refused take nothing, and the pairs refused together are excluded (a streamed answer is never
    `url`; `output_compression` is for jpeg and webp; `partial_images` needs `stream`)."""
    props = schema["properties"]
    for field, words in CHOICES.items():
        props[field] = words_schema(words, nullable=True)
    for field in REFUSED_FIELDS:
        if field in props:
            props[field] = {"not": {}, "description": "refused (400 naming it): see docs/http-api.md"}
    present = {"not": {"type": "null"}}
    schema["allOf"] = [
        {
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            "then": {"properties": {"response_format": {"not": {"const": "url"}}}},
        },
        {
            "if": {"properties": {"output_compression": present}, "required": ["output_compression"]},
            "then": {"properties": {"output_format": {"enum": COMPRESSED}}, "required": ["output_format"]},
        },
        {
            "if": {"properties": {"partial_images": {"type": "integer", "minimum": 1}}, "required": ["partial_images"]},
            "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        },
    ]


# The multipart forms, by the JSON schema they take the fields of, and their files (the first is required).
FORMS = {
    "/v1/images/edits": ("ImageEditRequest", {"image": IMAGE_FILE, "mask": IMAGE_FILE}),
    "/v1/videos": ("VideoCreateRequest", {"input_reference": IMAGE_FILE}),
}


def form_schema(
    components: dict, path: str, lora_names: tuple[str, ...] | None = None, untaken: frozenset[str] = frozenset()
) -> dict:
    """A route's multipart form, from its JSON schema (as narrowed for the model served): each field as a form sends
    it (text: a number or word as the JSON field takes it, no null; `lora` as JSON text; the lists and objects only
    JSON bodies take, none), the pairs refused together, and its files (an edit's image required; a video's
    reference where the JSON schema requires one; none the model does not take, in `untaken`). `lora_names`: the
    adapters registered now (None: any, the code's document)."""
    name, files = FORMS[path]
    body = components[name]
    properties: dict[str, Any] = {key: _form_field(key, schema) for key, schema in body["properties"].items()}
    properties["prompt"] = {"type": "string", **PROMPT}
    properties |= {key: {"not": {}} if key in untaken else file for key, file in files.items()}
    if lora_names is not None and "lora" in properties:  # JSON text naming one registered adapter, or none
        properties["lora"] = {**FORM_LORA, "enum": ["[]", *(f'[{{"name": "{n}"}}]' for n in lora_names)]}
    first = [next(iter(files))] if name == "ImageEditRequest" else []
    required = [*first, "prompt", *(key for key in body.get("required", []) if key != "prompt")]
    # Only these fields: the form refuses others by name, as the JSON bodies do.
    form = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    if "allOf" in body:
        form["allOf"] = body["allOf"]
    return form


# A form's `lora`: JSON text of the list (daemon/api.py `json_fields`).
FORM_LORA = {"type": "string", "contentMediaType": "application/json", "description": 'JSON text: [{"name": ...}]'}
# A form's `arguments`: JSON text of the object.
FORM_ARGUMENTS = {"type": "string", "contentMediaType": "application/json", "description": 'JSON text: {"name": value}'}


def _form_field(name: str, schema: dict) -> dict:
    """A JSON field's schema as a form field: its options without null (a form leaves a field out instead); a field
    taken only as null, or only as a list or object (JSON bodies), takes nothing."""
    if name == "lora":
        return FORM_LORA
    if name == "arguments" and any(o.get("type") == "object" for o in options(schema)):
        return FORM_ARGUMENTS  # taken by the model served (a family's call switches)
    texts = [o for o in options(schema) if o.get("type") not in ("null", "array", "object")]
    if not texts:
        return {"not": {}, "description": schema.get("description", "taken in JSON bodies only")}
    return texts[0] if len(texts) == 1 else {"anyOf": texts}


def _id_param(name: str) -> list[dict]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "maxLength": 256}}]


def document() -> dict:
    """The OpenAPI document of every route (the code's; `served_document`: a loaded model's)."""
    _, components = msgspec.json.schema_components(
        [
            ImageGenerationRequest,
            ImageEditRequest,
            GenerationRequest,
            VideoCreateRequest,
            AudioCreateRequest,
            LoraCreateRequest,
        ],
        ref_template=REF,
    )
    components["Error"] = ERROR
    for name in ("ImageGenerationRequest", "ImageEditRequest", "GenerationRequest", "VideoCreateRequest",
                 "AudioCreateRequest"):  # fmt: skip
        components[name]["properties"]["prompt"].update(PROMPT)
    for name in ("ImageGenerationRequest", "ImageEditRequest"):
        _openai_words(components[name])
    native = components["GenerationRequest"]["properties"]
    _base64_images(native)
    native["output_format"] = {**words_schema(CHOICES["output_format"]), "default": "png"}
    components["GenerationRequest"]["allOf"] = [  # daemon/native_api.py `parse_generation`: latents ride previews
        {
            "if": {"properties": {"latents": {"const": True}}, "required": ["latents"]},
            "then": {"properties": {"preview_every": {"minimum": 1}}, "required": ["preview_every"]},
        }
    ]
    for name in ("GenerationRequest", "ImageEditRequest"):
        _least_strength(components[name]["properties"])
    images = _ok(
        "images (or, with stream=true, an SSE stream of partial and completed images)", {JSON: IMAGES, SSE: SSE_EVENT}
    )
    generated = ("404 `model` is not the served model", "500 the generation failed")
    paths = {
        "/v1/images/generations": {
            "post": {
                "summary": "OpenAI Images: generations",
                "requestBody": _body(_ref("ImageGenerationRequest")),
                "responses": _responses(images, *generated),
            }
        },
        "/v1/images/edits": {
            "post": {
                "summary": "OpenAI Images: edits (multipart)",
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": form_schema(components, "/v1/images/edits")}},
                },
                "responses": _responses(images, *generated),
            }
        },
        "/v1/generations": {
            "post": {
                "summary": "Native: one request's progress, previews, latents and result as Server-Sent Events",
                "requestBody": _body(_ref("GenerationRequest")),
                "responses": _responses(_ok("an SSE stream", {SSE: SSE_EVENT})),
            }
        },
        "/v1/generations/{id}/events": {
            "parameters": [
                *_id_param("id"),
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[0-9]{1,12}$"},
                },
            ],
            "get": {
                "summary": "A native stream's events after Last-Event-ID, then the live ones (within the window)",
                "responses": _responses(
                    _ok("an SSE stream", {SSE: SSE_EVENT}), "404 no such request, or its events are no longer kept"
                ),
            },
        },
        "/v1/generations/{id}": {
            "parameters": _id_param("id"),
            "get": {
                "summary": "A request's status",
                "responses": _responses(_ok("status", {JSON: RECORD}), "404 no such request"),
            },
            "delete": {
                "summary": "Cancel a request at its next step",
                "responses": _responses(
                    _ok("cancel requested", {JSON: RECORD}, "202"), "404 no such request", "409 already finished"
                ),
            },
        },
        **_jobs(
            "/v1/videos",
            "video",
            VIDEO,
            {"video/mp4": STR, "image/webp": STR},
            "OpenAI Videos: create a job (JSON or multipart)",
            _body(_ref("VideoCreateRequest"), form=form_schema(components, "/v1/videos")),
        ),
        **_jobs(
            "/v1/audio/generations",
            "audio",
            AUDIO,
            {"audio/wav": STR, "audio/flac": STR},
            "Sound models: create a job (JSON)",
            _body(_ref("AudioCreateRequest")),
        ),
        "/v1/files/{id}/content": {
            "parameters": [
                *_id_param("id"),
                {"name": "expires", "in": "query", "required": True, "schema": {"type": "string", "maxLength": 32}},
                {"name": "signature", "in": "query", "required": True, "schema": {"type": "string", "maxLength": 128}},
            ],
            "get": {
                "summary": "An image answered by URL (response_format url): signed, expiring, no API key",
                "security": [],
                "responses": _responses(
                    _ok(
                        "the file",
                        {
                            m: STR
                            for m in ("image/png", "image/jpeg", "image/webp", "video/mp4", "audio/wav", "audio/flac")
                        },
                    ),
                    "404 no such file, expired, or not signed here",
                ),
            },
        },
        "/v1/loras": {
            "get": {"summary": "LoRA adapters", "responses": _responses(_ok("adapters", {JSON: _list(LORA)}))},
            "post": {
                "summary": "Register a LoRA file of --lora-dir",
                "requestBody": _body(_ref("LoraCreateRequest")),
                "responses": _responses(_ok("registered", {JSON: LORA}, "201"), "409 the name is taken"),
            },
        },
        "/v1/loras/{name}": {
            "parameters": _id_param("name"),
            "delete": {
                "summary": "Forget an adapter",
                "responses": _responses(
                    _ok("deleted", {JSON: _obj({"name": STR, "deleted": BOOL})}), "404 no such adapter"
                ),
            },
        },
        "/v1/models": {
            "get": {
                "summary": "The served model, under each of its names (--served-model-name: the first its own)",
                "responses": _responses(_ok("models", {JSON: _list(_obj({"id": STR}))})),
            }
        },
        "/v1/models/{model}": {
            "parameters": _id_param("model"),
            "get": {
                "summary": "The served model under one of its names",
                "responses": _responses(_ok("model", {JSON: _obj({"id": STR})}), "404 not a name served here"),
            },
        },
        "/health": {"get": {"summary": "Liveness", "responses": _probe("alive")}},
        "/ready": {"get": {"summary": "Readiness", "responses": _probe("ready (503: loading, draining or failed)")}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": _responses(
                    _ok(
                        "text format (OpenMetrics when asked for)",
                        {"text/plain": STR, "application/openmetrics-text": STR},
                    )
                ),
            }
        },
        "/openapi.json": {
            "get": {"summary": "This document", "responses": _responses(_ok("OpenAPI 3.1", {JSON: {"type": "object"}}))}
        },
        "/": {"get": {"summary": "The playground", "responses": _responses(_ok("HTML", {"text/html": STR}))}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "diffusiond", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _jobs(prefix: str, kind: str, job: dict, files: dict[str, dict], summary: str, body: dict) -> dict:
    """The routes of one kind of job (daemon/jobs_api.py) under `prefix`."""
    missing = "404 no such job"
    return {
        prefix: {
            "post": {
                "summary": summary,
                "requestBody": body,
                "responses": _responses(
                    _ok("the job", {JSON: job}), "404 `model` is not the served model", "507 the job store is full"
                ),
            },
            "get": {"summary": f"{kind.capitalize()} jobs", "responses": _responses(_ok("jobs", {JSON: _list(job)}))},
        },
        prefix + "/{id}": {
            "parameters": _id_param("id"),
            "get": {"summary": f"A {kind} job", "responses": _responses(_ok("the job", {JSON: job}), missing)},
            "delete": {
                "summary": "Delete a job and its file",
                "responses": _responses(_ok("deleted", {JSON: _obj({"id": STR, "deleted": BOOL})}), missing),
            },
        },
        prefix + "/{id}/content": {
            "parameters": _id_param("id"),
            "get": {
                "summary": "A completed job's file",
                "responses": _responses(_ok(f"the {kind}", files), missing, "409 not completed"),
            },
        },
    }


def _probe(ok: str) -> dict:
    out = _responses(_ok(ok, {JSON: _obj({"status": STR})}))
    out["503"] = {"description": "not so", "content": {JSON: {"schema": {"anyOf": [_obj({"status": STR}), ERROR]}}}}
    return out
