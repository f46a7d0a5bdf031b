"""Load a model from a local diffusers folder or a hub id: read `model_index.json`, pick the adapter, load."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diffusiond.models.base import ModelAdapter
from diffusiond.models.registry import adapter_for

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_model_index(model: str) -> dict:
    if os.path.isdir(model):
        path = Path(model) / "model_index.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model} has no model_index.json: not a diffusers checkpoint folder")
    elif model.startswith((".", "/", "~")) or os.path.exists(model):
        raise FileNotFoundError(f"{model} is not a checkpoint folder")
    else:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "model_index.json"))
    return json.loads(path.read_text())


def load_adapter(
    model: str,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    quantize: str = "none",
    quantize_skip: str | None = None,
    offload: str = "none",
    scheduler_config: Mapping[str, Any] | None = None,
) -> ModelAdapter:
    """The adapter for `model`, loaded through its pipeline's `from_pretrained`; with `quantize`, its transformer's
    linear layers quantized (kernels/quantize.py; `quantize_skip`: comma-separated name patterns left alone); with
    `offload`, loaded to CPU memory and run on `device` (kernels/offload.py); with `scheduler_config`, those
    settings of its scheduler changed (`change_scheduler`)."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    index = read_model_index(model)
    cls = adapter_for(index.get("_class_name", "<missing _class_name>"))
    adapter = cls.from_pretrained(model, device="cpu" if offload != "none" else device, dtype=torch_dtype)
    if scheduler_config:
        adapter.pipe.scheduler = change_scheduler(adapter.pipe.scheduler, scheduler_config)
    if quantize != "none":
        from diffusiond.kernels.quantize import DEFAULT_SKIP, quantize_layers

        skip = DEFAULT_SKIP if quantize_skip is None else tuple(filter(None, map(str.strip, quantize_skip.split(","))))
        adapter.quantized = (quantize, quantize_layers(adapter.transformer, quantize, skip))
    if offload != "none":
        adapter.enable_offload(offload, device)
    return adapter


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


def _supports(cls: type, strategy: str, flag: str, what: str) -> None:
    if strategy not in cls.parallel:
        raise ValueError(
            f"{flag}: the {cls.family} family ({cls.pipeline_class}) does not support {what}; it supports: "
            f"{', '.join(cls.parallel)}"
        )


def _heads(model: str) -> int | None:
    """The transformer's attention heads from its config.json (Z-Image calls them `n_heads`); None if unknown."""
    config = Path(model) / "transformer" / "config.json"
    fields = json.loads(config.read_text()) if config.is_file() else {}
    return fields.get("num_attention_heads") or fields.get("n_heads")


def check_features(
    model: str,
    *,
    ulysses: int = 1,
    ring: int = 1,
    tp: int = 1,
    shard_weights: bool = False,
    vae_parallel: int = 1,
    cache: str = "none",
    lora: bool = False,
) -> None:
    """Raises ValueError, saying why, when the family of `model` cannot run the parallel layout, step cache or LoRA
    adapters asked for: read from `model_index.json` and the family's declarations, before any rank starts or loads."""
    cls = adapter_for(read_model_index(model).get("_class_name", "<missing _class_name>"))
    if lora and not cls.lora:
        raise ValueError(f"--lora: the {cls.family} family ({cls.pipeline_class}) does not serve LoRA adapters")
    heads = _heads(model) if ulysses > 1 or tp > 1 else None
    if ulysses > 1:
        _supports(cls, "ulysses", f"--ulysses {ulysses}", "Ulysses sequence parallelism")
        if heads:
            from diffusiond.kernels.ulysses import check_heads

            check_heads(heads, ulysses)
    if ring > 1:
        _supports(cls, "ring", f"--ring {ring}", "ring attention")
    if tp > 1:
        _supports(cls, "tp", f"--tp {tp}", "tensor parallelism")
        if heads and heads % (tp * ulysses):
            raise ValueError(f"--tp {tp} x --ulysses {ulysses} must divide the number of attention heads ({heads})")
        if cache != "none":
            raise ValueError(f"--cache {cache} with --tp {tp}: step caching does not run with tensor parallelism yet")
    if vae_parallel > 1 and "vae-parallel" not in cls.parallel:
        raise ValueError(
            f"--vae-parallel {vae_parallel}: the {cls.family} family's VAE ({cls.pipeline_class}) does not decode "
            "in strips (a video VAE)"
        )
    if shard_weights:
        if "shard-weights" not in cls.parallel:
            raise ValueError(f"--shard-weights: the {cls.family} family ({cls.pipeline_class}) does not support it")
        if cache != "none":
            raise ValueError(f"--cache {cache} with --shard-weights: step caching does not run on sharded weights yet")
    if cache != "none" and ring > 1:
        raise ValueError(f"--cache {cache} with --ring {ring}: step caching does not run with ring attention yet")
    if cache != "none" and ulysses > 1 and not cls.cache_with_ulysses:
        raise ValueError(f"--cache {cache} with --ulysses {ulysses}: the {cls.family} family cannot combine them yet")
    if cache != "none" and cache not in cls.cache_methods:
        offered = ", ".join(cls.cache_methods) or "none"
        raise ValueError(f"--cache {cache}: the {cls.family} family implements {offered}")
