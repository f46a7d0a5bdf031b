"""Small host values (row indices, per-row scales) for the device, without a host-device sync.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the copy, which waits for the
stream: a sync per call. Built on the host and sent with `non_blocking=True`, the copy is queued behind the work
already on the stream and the host goes on (STYLE.md: no syncs on the hot path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[float] | Sequence[int], device: torch.device | str, dtype=None) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)
