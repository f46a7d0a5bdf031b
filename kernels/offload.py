"""Offload (`--offload model|group`): weights wait in CPU memory and go to the accelerator when they run, for GPUs
with less memory than the model.

- `model`: one stage's components on the device at a time. The engine's stages are encoding prompts (the text
  encoders), denoising (the transformer) and decoding (the VAE, also for VAE previews); before a stage runs, the
  components of the previous one go back to CPU memory and its own come to the device. Peak memory: the largest
  stage instead of the sum. diffusers' `enable_model_cpu_offload` is not used: its hooks offload the previous model
  of the pipeline's fixed sequence when the next one's forward runs, which suits one `__call__`, but in serving new
  requests encode their prompts between denoising steps, and the text encoders would then join the transformer and
  the VAE on the device. The step cache's forward calls the transformer's blocks directly, which forward hooks
  would miss too.
- `group`: the transformer's layers stream to the device one at a time (diffusers' group offloading, leaf level,
  so that every call path onloads what it uses), prefetched on a CUDA stream while the previous layer computes;
  text encoders and VAE stay on the device.

The model loads to CPU memory first (`load_adapter` with `offload`), so it never has to fit on the device whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

CHOICES = ("none", "model", "group")


class OffloadUnavailable(ValueError):
    """The chosen offload cannot run here (message says why)."""


def check(choice: str, device: str) -> None:
    """Raises OffloadUnavailable when `choice` makes no sense on `device`. No torch work."""
    if choice not in CHOICES:
        raise OffloadUnavailable(f"unknown offload {choice!r}; choose from {', '.join(CHOICES)}")
    if choice == "none":
        return
    if not device.startswith("cuda"):
        raise OffloadUnavailable(f"--offload {choice} needs a CUDA device: it keeps weights in CPU memory for one")
    import torch

    if not torch.cuda.is_available():
        raise OffloadUnavailable(f"--offload {choice} needs a CUDA device, and none is available here")


class StageOffload:
    """`model` offload: moves whole components between CPU memory and `device` when the stage changes."""

    def __init__(self, components: dict[str, Any], device: Any) -> None:
        import torch

        self.components = {name: m for name, m in components.items() if isinstance(m, torch.nn.Module)}
        self.device = torch.device(device)
        self.resident: frozenset[str] = frozenset()
        for module in self.components.values():
            module.to("cpu")

    def stage(self, names: Iterable[str]) -> None:
        """Make `names` (those that exist) the components on the device; the others go back to CPU memory."""
        wanted = frozenset(n for n in names if n in self.components)
        if wanted == self.resident:
            return
        for name in self.resident - wanted:
            self.components[name].to("cpu")
        for name in wanted - self.resident:
            self.components[name].to(self.device)
        self.resident = wanted


def group_offload(transformer: Any, device: Any) -> None:
    """`group` offload of the transformer: leaf-level groups onloaded to `device` as they run, with a CUDA stream
    prefetching the next one where the device is CUDA."""
    import torch

    device = torch.device(device)
    transformer.enable_group_offload(
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="leaf_level",
        use_stream=device.type == "cuda",
    )
