"""A diffusers pipeline loaded as the served model holds it: through the pipeline class's own `from_pretrained`, its
modules moved to the device in eval mode without gradients, a 2-D VAE channels-last on the CPU, and optionally its
denoisers built empty, their weights read a part at a time as a parallel layout shards them. The dedicated families
(models/flowmatch/adapter.py) and the generic path (models/generic/) load through it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import diffusers
import torch

from diffusiond.models.loading.lazy_weights import LazyWeights, empty_model
from diffusiond.models.loading.registry import read_model_index


def channels_last_vae(vae: torch.nn.Module) -> None:
    """On the CPU, a 2-D VAE's convolution weights in channels-last layout (its activations follow them): oneDNN
    then splits one image's convolutions over the threads as well as a batch's. Measured here (2 threads, one image
    a call): an SD3-sized VAE (128-512 channels) decoding 256x256 2.11 -> 1.72 s and 512x512 10.2-10.5 -> 7.7-8.0 s,
    tiny SD3 at 256x256 15-20 -> 11-13 ms, the bundled model 4.7-5.3 -> 3.6 ms; two or more images a call: the same
    (0.97-1.03x), but the bundled model's 8 in 0.67-0.74x. Results differ by float rounding (2e-5 of [-1, 1]). 3-D
    (video) VAEs are left as they are, and GPUs too: neither was measured."""
    if all(p.dim() != 5 for p in vae.parameters()):
        vae.to(memory_format=torch.channels_last)


def null_components(source: str) -> dict[str, None]:
    """Components the checkpoint saved as None (`[null, null]` in model_index.json, e.g. SD3 without T5), to pass
    as None again: diffusers drops them on load and then insists on every required component being there."""
    index = read_model_index(source)
    return {name: None for name, value in index.items() if isinstance(value, list) and value == [None, None]}


def load_pipeline(
    pipeline_class: str,
    path: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy: Sequence[str] = (),
) -> tuple[Any, str, dict[str, LazyWeights]]:
    """(pipeline, the checkpoint's folder, the denoisers built empty by name). `lazy`: the components to build
    empty (those the checkpoint has), for a layout that shards them (models/loading/lazy_weights.py)."""
    pipeline_cls = getattr(diffusers, pipeline_class)
    components: dict[str, Any] = null_components(path)
    lazies: dict[str, LazyWeights] = {}
    if lazy:
        root = Path(path if os.path.isdir(path) else pipeline_cls.download(path))
        index = read_model_index(str(root))
        for name in lazy:
            entry = index.get(name)
            if not isinstance(entry, list) or entry[1] is None:  # a checkpoint without it (Wan 2.1)
                continue
            components[name] = empty_model(getattr(diffusers, entry[1]), root / name, dtype)
            lazies[name] = LazyWeights(components[name], root / name, torch.device(device))
        path = str(root)
    pipe = pipeline_cls.from_pretrained(path, dtype=dtype, **components)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            if name not in lazies:
                module.to(device)
            module.eval().requires_grad_(False)
    vae = getattr(pipe, "vae", None)
    if torch.device(device).type == "cpu" and isinstance(vae, torch.nn.Module):
        channels_last_vae(vae)
    pipe.set_progress_bar_config(disable=True)
    return pipe, path, lazies
