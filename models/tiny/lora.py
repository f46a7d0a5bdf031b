"""Tiny random LoRA files for a tiny checkpoint, offline, in diffusers' own LoRA format: PEFT adapters with random
(non-zero) factors on the denoiser's attention projections, saved by the pipeline class's `save_lora_weights` with
their `LoraConfig` as metadata, exactly as a LoRA trained with diffusers' scripts is published."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Attention projections of every family's blocks (diffusers' names): the modules LoRA training scripts target.
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def build_tiny_lora(
    model_dir: str | Path, out: str | Path, *, seed: int, rank: int = 4, alpha: float = 8.0, std: float = 0.2
) -> Path:
    """A LoRA for the checkpoint in `model_dir`, written to `out` (a .safetensors file); returns its path."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model_index = diffusers.DiffusionPipeline.load_config(str(model_dir))
    pipeline_class = getattr(diffusers, model_index["_class_name"])
    component = "unet" if "unet" in model_index else "transformer"
    _, class_name = model_index[component]
    denoiser_class = getattr(diffusers, class_name)
    denoiser = denoiser_class.from_pretrained(Path(model_dir) / component)
    present = {name.rsplit(".", 1)[-1] for name, _ in denoiser.named_modules()} | {
        ".".join(name.rsplit(".", 2)[-2:]) for name, _ in denoiser.named_modules()
    }
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=[t for t in TARGETS if t in present], init_lora_weights=False
    )
    denoiser.add_adapter(config, adapter_name="tiny")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    layers: dict[str, Any] = get_peft_model_state_dict(denoiser, adapter_name="tiny")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pipeline_class.save_lora_weights(
        str(out.parent),
        weight_name=out.name,
        **{f"{component}_lora_layers": layers, f"{component}_lora_adapter_metadata": config.to_dict()},
    )
    return out
