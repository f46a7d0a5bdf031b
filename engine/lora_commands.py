"""LoRA adapters registered and removed while serving: the event loop queues a command, the step thread runs it
between steps. Rank 0 changes its registry first (a bad file fails there, before any other rank reads it), then the
other ranks follow through a LORA plan (engine/executor.py applies it). Also the scheduler's gate: a request with
adapters joins once they fit in the LoRA budget beside those in use."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from diffusiond.engine.comm import Communicator
from diffusiond.engine.scheduler import SchedRequest
from diffusiond.engine.wire import LoraOp, LoraOpKind, PlanKind, StepPlan, encode_plan
from diffusiond.models.base import ModelAdapter
from diffusiond.models.lora.files import LoraError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraCommand:
    """Register or remove a LoRA adapter (on the step thread; in a group, every rank does the same)."""

    op: LoraOp
    future: asyncio.Future


def listing(adapter: ModelAdapter | None) -> list[dict]:
    """The registered adapters (name, path, bytes, resident), by name."""
    registry = adapter.lora_registry if adapter is not None else None
    if registry is None:
        return []
    return [entry.public() for _, entry in sorted(registry.entries.items())]


def run(command: LoraCommand, adapter: ModelAdapter, comm: Communicator, settle: Callable) -> None:
    """Step thread: the change on this rank's registry, then a LORA plan for the others; `settle(future, error,
    value)` answers the caller on its event loop."""
    op = command.op
    registry = adapter.lora_registry
    try:
        if registry is None:
            raise LoraError("this server serves no LoRA adapters (its model's family, or its parallel layout)")
        entry = registry.register(op.name, op.path) if op.kind == LoraOpKind.REGISTER else registry.unregister(op.name)
    except Exception as exc:
        if not isinstance(exc, LoraError):
            log.exception("LoRA %s %s failed", op.kind.name.lower(), op.name)
            exc = LoraError(f"{op.name}: could not be loaded: {type(exc).__name__}")
        settle(command.future, exc)
        return
    if comm.world_size > 1:
        if op.kind == LoraOpKind.REGISTER:
            op = msgspec.structs.replace(op, sha256=entry.sha256)  # the other ranks must read these bytes
        comm.broadcast(encode_plan(StepPlan(step=-1, kind=PlanKind.LORA, loras=[op])))
    settle(command.future, None, entry.public())


def fits(adapter: ModelAdapter, request: SchedRequest, running: list[SchedRequest]) -> bool:
    """Scheduler gate: a request with adapters joins once they fit in the LoRA budget beside those in use."""
    registry = adapter.lora_registry
    if registry is None or not request.params.lora:
        return True
    return registry.fits(c.name for r in (*running, request) for c in (r.params.lora or ()))
