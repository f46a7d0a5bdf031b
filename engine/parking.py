"""Where a paused request's state waits (issue 34's preemption): every rank keeps it, unchanged, in its table; on a
GPU its tensors move to host memory while it waits, under a byte budget (`--paused-bytes`), and back when it is
admitted again. On the CPU nothing moves: the state simply sits out of the batch.

A state is the adapter's `RequestState`: latents, conditioning, the request's own sampler (a diffusers scheduler
object, whose sigmas and multistep history are tensors), its step cache's residuals and an inpainting mask. What it
holds is found by walking it (dataclass fields, dicts, lists, tuples and plain objects' attributes), so a family that
keeps something new in its state moves with it; modules (shared weights) and the LoRA selection are never touched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from diffusiond.models.base import RequestState

log = logging.getLogger(__name__)

# Host memory for paused states on a GPU; beyond it a paused state stays on the device.
PAUSED_BYTES = 8 << 30
# What a walk never enters: shared weights, and the request's LoRA selection (resident adapters, shared).
_SKIP_FIELDS = frozenset({"params", "lora"})
_ATOMS = (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)
_KEEP = (*_ATOMS, torch.nn.Module, torch.Generator, type)
# How deep a walk enters plain objects: the state's own (sampler, step cache, inpainting) and what they hold.
OBJECT_DEPTH = 2


def move_tensors(state: RequestState, move: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Replace every tensor the state holds by `move(tensor)`; returns the bytes of the tensors it saw. Containers
    (dicts, lists, tuples) are rebuilt, never changed in place, as several states may share one (a batch's `shared`
    conditioning); objects (the sampler, the step cache's state, an inpainting mask) are the request's own and get
    their attributes replaced, down to OBJECT_DEPTH. A tensor held twice is moved once and stays one tensor."""
    done: dict[int, torch.Tensor] = {}
    seen = 0

    def one(value, depth: int):
        nonlocal seen
        if isinstance(value, torch.Tensor):
            if id(value) not in done:
                done[id(value)] = move(value)
                seen += value.numel() * value.element_size()
            return done[id(value)]
        if isinstance(value, _KEEP):
            return value
        if isinstance(value, dict):
            items = {k: one(v, depth) for k, v in value.items()}
            changed = any(items[k] is not v for k, v in value.items())
            return type(value)(items) if changed and type(value) is not dict else items if changed else value
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            items = [one(v, depth) for v in value]
            changed = any(a is not b for a, b in zip(items, value, strict=True))
            return (items if isinstance(value, list) else tuple(items)) if changed else value
        if depth < OBJECT_DEPTH:
            for name in _attributes(value):
                old = getattr(value, name, None)
                new = one(old, depth + 1)
                if new is not old:
                    object.__setattr__(value, name, new)
        return value

    for f in dataclasses.fields(state):
        if f.name not in _SKIP_FIELDS:
            setattr(state, f.name, one(getattr(state, f.name), 0))
    return seen


def _attributes(value: object) -> list[str]:
    """The attributes an object holds its data in: a dataclass's fields, its __dict__, its __slots__."""
    if dataclasses.is_dataclass(value):
        return [f.name for f in dataclasses.fields(value)]
    names = list(vars(value)) if hasattr(value, "__dict__") else []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return names


class Parking:
    """The paused states of one rank: on a CUDA device, their device tensors moved to host memory while they wait,
    as long as they fit in `budget` bytes; only what was moved goes back (a sampler's host tensors stay there)."""

    def __init__(self, device: torch.device | str, budget: int = PAUSED_BYTES) -> None:
        self.device = torch.device(device)
        self.budget = budget
        self.offloads = self.device.type == "cuda"
        # request id -> (bytes in host memory, ids of the host copies to move back).
        self.held: dict[str, tuple[int, set[int]]] = {}

    @property
    def used(self) -> int:
        return sum(size for size, _ in self.held.values())

    def moves(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device or (self.device.type == "cuda" and tensor.device.type == "cuda")

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu")

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def park(self, state: RequestState) -> None:
        if not self.offloads:
            return
        size = [0]

        def count(tensor: torch.Tensor) -> torch.Tensor:
            size[0] += tensor.numel() * tensor.element_size() if self.moves(tensor) else 0
            return tensor

        move_tensors(state, count)
        if self.used + size[0] > self.budget:
            log.info(
                "request %s stays on the device while paused: %d bytes over --paused-bytes", state.request_id, size[0]
            )
            return
        copies: set[int] = set()

        def out(tensor: torch.Tensor) -> torch.Tensor:
            if not self.moves(tensor):
                return tensor
            copy = self.to_host(tensor)
            copies.add(id(copy))
            return copy

        try:
            move_tensors(state, out)
        except BaseException:  # what moved goes back: the state stays whole, on the device
            move_tensors(state, lambda t: self.to_device(t) if id(t) in copies else t)
            raise
        self.held[state.request_id] = (size[0], copies)

    def resume(self, state: RequestState) -> None:
        held = self.held.pop(state.request_id, None)
        if held is not None:
            copies = held[1]
            move_tensors(state, lambda t: self.to_device(t) if id(t) in copies else t)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.held.pop(request_id, None)
