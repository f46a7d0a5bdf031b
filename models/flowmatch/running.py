"""How a flow-matching family's model runs on its device: weights offloaded to CPU memory (kernels/offload.py),
repeated blocks compiled (kernels/compile.py), attention routed to a backend (kernels/attention.py). Each reads the
pieces it is handed, never the adapter; the adapter's `enable_offload`, `enable_compile` and `set_attention` say
what they set on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusiond.kernels import attention


def offload(mode: str, device: str, components: dict[str, Any], experts: Sequence[Any]) -> Any:
    """Keep weights in CPU memory and bring them to `device` as they run; the components were loaded to CPU memory.
    `model`: one stage's components at a time (a two-expert checkpoint: the expert a step runs), the returned
    StageOffload brings them; `group`: every expert streamed layer by layer, the rest moved to the device (None
    returned); `none`: nothing."""
    from diffusiond.kernels import offload as kernels

    if mode == "model":
        return kernels.StageOffload(components, device)
    if mode == "group":
        ids = {id(expert) for expert in experts}
        for module in components.values():
            if isinstance(module, torch.nn.Module) and id(module) not in ids:
                module.to(device)
        for expert in experts:  # never moved whole: each streamed layer by layer
            kernels.group_offload(expert, device)
        return None
    if mode != "none":
        raise kernels.OffloadUnavailable(f"unknown offload {mode!r}")
    return None


def compile_experts(experts: Sequence[Any], repeated_blocks: tuple[str, ...]) -> int:
    """torch.compile each expert's repeated blocks; they compile at their first call, which the warm-up makes. How
    many blocks."""
    from diffusiond.kernels.compile import compile_blocks

    return sum(compile_blocks(expert, repeated_blocks) for expert in experts)


def route_attention(
    choice: str, experts: Sequence[Any], device: torch.device, dtype: torch.dtype, *, masked: bool, family: str
) -> str:
    """Every attention layer of the experts (Ulysses ones included, so call it after the group is set up) to the
    backend `choice` means on this device; the resolved name. Python objects only, no torch work."""
    backend = attention.resolve(choice, device, dtype)
    routed = sum(attention.apply(expert, backend, masked=masked) for expert in experts)
    if not routed and backend != "sdpa":
        # No layer dispatches its attention (SDXL's UNet calls SDPA itself).
        if choice != "auto":
            from diffusiond.models.loading.setup import SetupError

            raise SetupError(f"--attention {choice}: the {family} family's attention runs SDPA only")
        backend = "sdpa"
    return backend
