"""Load a model from a local diffusers folder or a hub id: read `model_index.json`, pick the adapter, load it, and
change what loading changes (scheduler settings, quantized linears, offloaded weights). models/loading/setup.py builds
the rest of a served model on top."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from diffusiond.models.base import ModelAdapter
from diffusiond.models.loading.registry import adapter_class, family_of_checkpoint
from diffusiond.models.loading.setup import SetupError, resolve_dtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_adapter(
    model: str,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    quantize: str = "none",
    quantize_skip: str | None = None,
    offload: str = "none",
    scheduler_config: Mapping[str, Any] | None = None,
    lazy_denoiser: bool = False,
    adapter: str = "auto",
) -> ModelAdapter:
    """The adapter for `model`, loaded through its pipeline's `from_pretrained`; with `quantize`, its transformer's
    linear layers quantized (kernels/quantize.py; `quantize_skip`: comma-separated name patterns left alone); with
    `offload`, loaded to CPU memory and run on `device` (kernels/offload.py); with `scheduler_config`, those
    settings of its scheduler changed (`change_scheduler`). `dtype` "auto": models/loading/setup.py `resolve_dtype`.
    `lazy_denoiser`: its denoiser built empty, for a layout that shards it (models/loading/lazy_weights.py).
    `adapter`: "auto" (the dedicated family, else the generic path) or "generic" (the generic path always)."""
    torch_dtype = DTYPES[resolve_dtype(dtype, device)] if isinstance(dtype, str) else dtype
    family = family_of_checkpoint(model, adapter)
    check_needs(family.family, family.needs)
    cls = adapter_class(family)
    device = "cpu" if offload != "none" else device
    loaded = cls.from_pretrained(model, device=device, dtype=torch_dtype, lazy_denoiser=lazy_denoiser)
    if scheduler_config:
        loaded.pipe.scheduler = change_scheduler(loaded.pipe.scheduler, scheduler_config)
    if quantize != "none":
        from diffusiond.kernels.quantize import DEFAULT_SKIP, quantize_layers

        skip = DEFAULT_SKIP if quantize_skip is None else tuple(filter(None, map(str.strip, quantize_skip.split(","))))
        loaded.quantized = (quantize, sum(quantize_layers(d, quantize, skip) for d in loaded.experts))
    if offload != "none":
        loaded.enable_offload(offload, device)
    return loaded


# The extra that installs each package a family may need (pyproject.toml).
EXTRA_OF = {"torchvision": "vision", "ftfy": "video", "torchsde": "audio"}


def check_needs(family: str, needs: tuple[str, ...]) -> None:
    """SetupError naming the packages a family's pipeline needs that are not installed (torchvision for the vision
    processors: the `vision` extra, which an image built without it lacks), before loading fails deep inside it."""
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if not missing:
        return
    extras = sorted({EXTRA_OF[name] for name in missing if name in EXTRA_OF})
    how = f"pip install 'diffusiond[{','.join(extras)}]'" if extras else f"pip install {' '.join(missing)}"
    if "torchvision" in missing:
        how += " with the torchvision release made for your torch (PyPI's are CUDA builds)"
    raise SetupError(f"the {family} family's pipeline needs {', '.join(missing)}, which is not installed: {how}")


def change_scheduler(scheduler: Any, changes: Mapping[str, Any]) -> Any:
    """The checkpoint's scheduler with some settings of its config changed (`--scheduler-config`), as diffusers
    users do with `type(s).from_config(s.config, **changes)`: the same class, so what the family checked of it
    at load (its order) still holds. A setting the scheduler does not have is refused, naming the ones it has."""
    known = {k for k in scheduler.config if not k.startswith("_")}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(
            f"--scheduler-config: {type(scheduler).__name__} has no setting {', '.join(map(repr, unknown))}; "
            f"it has: {', '.join(sorted(known))}"
        )
    return type(scheduler).from_config(scheduler.config, **changes)
