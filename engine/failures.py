"""What an error means to the serving group: a request's failure, the group's (every rank must restart), or the
device's (every later call on it fails too); and what a client is told (no exception text: details are in the log).
engine/executor.py applies these tiers stage by stage."""

from __future__ import annotations

import torch
import torch.distributed

from diffusiond.kernels.collectives import CommError


class GroupFault(RuntimeError):
    """An error inside a stage that may run collectives: the group cannot go on (all ranks must restart)."""


# A broken collective or a fault inside one is the group's failure, not a request's: it stops the engine.
FATAL = (CommError, GroupFault, torch.distributed.DistError)


def poisons_the_device(exc: BaseException) -> bool:
    """A CUDA error after which every later call on the device fails too (an illegal address, a device-side
    assert, a failed launch): retrying one request at a time or serving the next would fail them all, one by one.
    Running out of memory is not one: that request fails, the others go on."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith(("CUDA error", "CUDA driver error"))


def public_error(request_id: str, stage: str, rank: int | None = None) -> str:
    where = f" on rank {rank}" if rank is not None else ""
    return f"internal error while {stage} this request{where} (request {request_id}); details are in the server log"
