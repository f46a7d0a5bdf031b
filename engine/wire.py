"""Every message that crosses between ranks, and nothing else.

Only changes cross the wire (vLLM's NewRequestData / CachedRequestData split): a request's parameters once, when it
is admitted, then only ids. Latents never travel; every rank derives identical states from identical plans and seeds.
"""

from __future__ import annotations

import enum
import re

import msgspec

from diffusiond.models.params import SamplingParams


class PlanKind(enum.IntEnum):
    STEP = 0
    # Nothing to run: keeps idle followers out of collective timeouts.
    HEARTBEAT = 1
    # Every rank leaves its step loop after this plan, so no rank stays blocked in a collective.
    SHUTDOWN = 2
    # Only `loras`: rank 0 registered or removed adapters; the others do the same now.
    LORA = 3


class LoraOpKind(enum.IntEnum):
    REGISTER = 0
    UNREGISTER = 1


class LoraOp(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A change of the registered LoRA adapters (models/lora/registry.py); every rank reads the file itself, and
    checks it read the bytes rank 0 read (`sha256`)."""

    kind: LoraOpKind
    name: str
    path: str = ""
    sha256: str = ""


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    params: SamplingParams


class StepPlan(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step: int
    kind: PlanKind = PlanKind.STEP
    # Admitted this step: prepare them (encode prompts, draw initial latents) before the forward.
    new: list[NewRequest] = []
    # Run one denoising step for these, in one batched forward, in this order.
    advance: list[str] = []
    # Free these (cancelled or failed) before anything else.
    drop: list[str] = []
    # LoRA registrations, applied before anything else (kind LORA).
    loras: list[LoraOp] = []
    # Paused for a higher class (engine/scheduler.py): keep their states (a GPU's in host memory), out of the batch.
    pause: list[str] = []
    # Paused ones admitted again: their states go on from where they stopped (they are in `advance` too).
    resume: list[str] = []
    # Finished requests (or finishing with this step) whose decode may run pieces, in this order, the driver's
    # alone (`ModelAdapter.decode_in_pieces`). None: every request finishing with this step decodes whole, now.
    decode: list[str] | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.advance or self.drop or self.pause or self.resume or self.decode)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepPlan)
_new_decoder = msgspec.msgpack.Decoder(NewRequest)
_PARAM_FIELDS = SamplingParams.__struct_fields__
# A validation error inside an array-like NewRequest: `$[1]` is its params, `[k]` the k-th field of SamplingParams.
_PARAM_PATH = re.compile(r"`\$\[1\]\[(\d+)\]")


class WireError(ValueError):
    """A request that cannot cross the wire; `field` names the offending SamplingParams field when known."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_request(request: NewRequest) -> None:
    """Encode and decode one request exactly as a plan would carry it, so that a request which cannot be encoded
    (an integer msgpack cannot hold) or decoded (a value outside SamplingParams' bounds) fails alone, before it is
    queued, and never inside a step where it would stop the engine. Raises WireError."""
    try:
        data = _encoder.encode(request)
    except (OverflowError, TypeError, ValueError) as exc:
        # msgspec does not say which field; find it by encoding them one at a time.
        for name in _PARAM_FIELDS:
            try:
                _encoder.encode(getattr(request.params, name))
            except (OverflowError, TypeError, ValueError):
                raise WireError(name, f"{name} cannot be encoded: {exc}") from None
        raise WireError(None, f"request cannot be encoded: {exc}") from None
    try:
        _new_decoder.decode(data)
    except msgspec.ValidationError as exc:
        match = _PARAM_PATH.search(str(exc))
        name = _PARAM_FIELDS[int(match.group(1))] if match else None
        message = str(exc).split(" - at ")[0]
        raise WireError(name, f"{name or 'request'}: {message}") from None


def encode_plan(plan: StepPlan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes | bytearray | memoryview) -> StepPlan:
    return _decoder.decode(data)
