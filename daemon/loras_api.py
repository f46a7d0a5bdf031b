"""LoRA adapters at run time: `GET /v1/loras` lists the registered adapters, `POST /v1/loras` registers one from a
file in --lora-dir, `DELETE /v1/loras/{name}` forgets one. Requests then name them in `lora` (daemon/api.py).

The engine reads and checks a file on its step thread (every rank does, under several ranks); a file that does not
fit the model changes nothing. Requests in flight that use a deleted adapter finish with it."""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from diffusiond.daemon.api import ApiError, decode_body
from diffusiond.daemon.auth import require_admin
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.edge import read_body
from diffusiond.daemon.startup import model_setup
from diffusiond.daemon.state import STATE
from diffusiond.engine.engine import Engine, EngineDeadError
from diffusiond.models.loading.setup import lora_refusal
from diffusiond.models.lora.files import LoraError, check_name, in_directory
from diffusiond.models.lora.registry import LoraRegistry
from diffusiond.models.params import LORA_NAME

FilePath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class LoraCreateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/loras`: the name requests will use, and a .safetensors file (relative to --lora-dir, or absolute
    inside it)."""

    # Checked by models/lora/files.py `check_name` (its message); the schema says it.
    name: Annotated[str, msgspec.Meta(max_length=256, extra_json_schema={"pattern": LORA_NAME})]
    path: FilePath


async def list_loras(request: web.Request) -> web.Response:
    engine = request.app[STATE].require_engine()
    return _json({"object": "list", "data": [_public(entry) for entry in engine.loras()]})


async def create_lora(request: web.Request) -> web.Response:
    require_admin(request, "register LoRA adapters (every tenant's requests may name them)")
    state = request.app[STATE]
    data = await read_body(request, state.config.max_body_bytes)
    body = decode_body(data, LoraCreateRequest)
    engine = state.require_engine()
    registry = _registry(engine, state.config)
    try:
        check_name(body.name)
    except LoraError as exc:
        raise ApiError(400, str(exc), param="name", code="invalid_value") from None
    if body.name in registry.entries:
        raise _taken(body.name)
    try:
        path = in_directory(state.config.lora_dir, body.path)
    except LoraError as exc:
        raise ApiError(400, str(exc), param="path", code="invalid_value") from None
    try:
        entry = await engine.register_lora(body.name, path)
    except LoraError as exc:
        if body.name in registry.entries:  # another request took the name meanwhile
            raise _taken(body.name) from None
        raise ApiError(400, str(exc), param="path", code="invalid_lora") from None
    except EngineDeadError:
        raise _stopped() from None
    return _json(_public(entry), status=201)


async def delete_lora(request: web.Request) -> web.Response:
    require_admin(request, "delete LoRA adapters (every tenant's requests may name them)")
    engine = request.app[STATE].require_engine()
    name = request.match_info["name"]
    try:
        await engine.unregister_lora(name)
    except LoraError:
        raise ApiError(404, f"no LoRA adapter named {name!r}", param="name", code="not_found") from None
    except EngineDeadError:
        raise _stopped() from None
    return _json({"name": name, "object": "lora.deleted", "deleted": True})


def _registry(engine: Engine, config: ServeConfig) -> LoraRegistry:
    """The model's LoRA registry, or a 400 saying why this server has none."""
    registry = engine.adapter.lora_registry
    if registry is None:
        caps = engine.adapter.capabilities
        if not caps.lora:
            why = f"its model's family ({caps.family}) does not serve them"
        else:  # a setting it does not compose with yet
            why = lora_refusal(model_setup(config))
        raise ApiError(400, f"this server serves no LoRA adapters: {why or 'they are off'}", code="lora_unsupported")
    return registry


def _taken(name: str) -> ApiError:
    return ApiError(
        409, f"a LoRA adapter named {name!r} is already loaded; delete it first", param="name", code="lora_exists"
    )


def _stopped() -> ApiError:
    return ApiError(503, "the engine stopped; the server is restarting", type="server_error", code="unavailable")


def _public(entry: dict) -> dict:
    return {"object": "lora", **entry}


def _json(data: dict, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda o: msgspec.json.encode(o).decode())
