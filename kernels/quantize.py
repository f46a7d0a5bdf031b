"""Quantization of the transformer's linear layers with torchao (`--quantize`), after loading, on the thread that
owns torch.

- `int8`: int8 weights, activations as loaded (torchao `Int8WeightOnlyConfig`): a quarter of fp32's weight memory,
  half of bf16's; on GPUs with small batches it is also faster (weight bandwidth).
- `int8-dynamic`: int8 weights, and activations quantized per token at run time
  (`Int8DynamicActivationInt8WeightConfig`): int8 matmuls, for large batches on GPUs with int8 tensor cores.
- `fp8`: fp8 (e4m3) weights and activations, per-row scales (`Float8DynamicActivationFloat8WeightConfig`): CUDA GPUs of
  compute capability 8.9 and up (Ada, Hopper and later).

Only `nn.Linear` layers of the transformer are quantized, and not those whose qualified names match a skip pattern
(fnmatch): by default the embedders (patch, timestep, text), the final norm's modulation and the output
projection (`norm_out`, `proj_out`; a final layer holding both, `*final_layer*`), the layers most sensitive to
rounding and a small part of the weights. The text encoders and the VAE stay as loaded. Parity is approximate:
tests/kernels/test_quantize.py states the tolerance.

torchao is an optional dependency (`pip install 'diffusiond[quant]'`); a choice that cannot run here is refused at
start with the reason (`check`), before anything loads.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from importlib.util import find_spec
from typing import Any

CHOICES = ("none", "int8", "int8-dynamic", "fp8")
DEFAULT_SKIP = ("*embed*", "norm_out.*", "proj_out", "*final_layer*")
FP8_CAPABILITY = (8, 9)


class QuantizationUnavailable(ValueError):
    """The chosen quantization cannot run here (message says why)."""


def check(choice: str, device: str) -> None:
    """Raises QuantizationUnavailable when `choice` cannot run on `device` with what is installed. No torch work."""
    if choice not in CHOICES:
        raise QuantizationUnavailable(f"unknown quantization {choice!r}; choose from {', '.join(CHOICES)}")
    if choice == "none":
        return
    if find_spec("torchao") is None:
        raise QuantizationUnavailable(
            f"--quantize {choice} needs torchao: pip install 'diffusiond[quant]' (or torchao)"
        )
    if choice == "fp8":
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise QuantizationUnavailable("--quantize fp8 needs a CUDA device (compute capability 8.9 or higher)")
        index = torch.device(device).index or 0
        capability = torch.cuda.get_device_capability(index)
        if capability < FP8_CAPABILITY:
            raise QuantizationUnavailable(
                f"--quantize fp8 needs compute capability 8.9 or higher; {device} has {capability[0]}.{capability[1]}"
            )


def _config(choice: str) -> Any:
    from torchao import quantization as q

    if choice == "int8":
        return q.Int8WeightOnlyConfig()
    if choice == "int8-dynamic":
        return q.Int8DynamicActivationInt8WeightConfig()
    if choice == "fp8":
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow())
    raise QuantizationUnavailable(f"unknown quantization {choice!r}")


def selected(module: Any, skip: Sequence[str] = DEFAULT_SKIP) -> list[str]:
    """Qualified names of the linear layers of `module` that `quantize_layers` converts."""
    import torch

    return [
        name
        for name, child in module.named_modules()
        if isinstance(child, torch.nn.Linear) and not any(fnmatch.fnmatchcase(name, p) for p in skip)
    ]


def quantize_layers(module: Any, choice: str, skip: Sequence[str] = DEFAULT_SKIP) -> int:
    """Quantize `module`'s linear layers in place (not those matching `skip`); how many were converted."""
    if choice == "none":
        return 0
    from torchao.quantization import quantize_

    names = set(selected(module, skip))
    quantize_(module, _config(choice), filter_fn=lambda _, fqn: fqn in names)
    return len(names)


def is_quantized(weight: Any) -> bool:
    """Whether a weight is one of torchao's quantized tensor subclasses (not a plain float tensor)."""
    import torch

    return type(weight) is not torch.nn.Parameter and type(weight) is not torch.Tensor
