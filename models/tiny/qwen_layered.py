"""A tiny Qwen-Image-Layered checkpoint (`QwenImageLayeredPipeline`): an image decomposed into RGBA layers.

Qwen-Image-Edit's text side (a Qwen2.5-VL text encoder whose vision tower captions an image sent without a prompt,
its processor), a transformer with the layered layout (`use_layer3d_rope`: rotary positions per layer;
`use_additional_t_cond`: an RGB/RGBA embedding added to the timestep's), and an RGBA VAE (`input_channels=4`; it
decodes as many channels as it reads).
"""

from __future__ import annotations

from typing import Any


def build_qwenimage_layered() -> Any:
    from diffusers import AutoencoderKLQwenImage, QwenImageLayeredPipeline, QwenImageTransformer2DModel

    from diffusiond.models.tiny.qwen import build_qwenimage_edit_plus

    base = build_qwenimage_edit_plus()
    # Qwen-Image's tiny transformer and VAE, in the layered layout.
    layout = {"use_layer3d_rope": True, "use_additional_t_cond": True}
    transformer = QwenImageTransformer2DModel.from_config({**_config(base.transformer), **layout})
    vae = AutoencoderKLQwenImage.from_config({**_config(base.vae), "input_channels": 4})  # RGBA in and out
    return QwenImageLayeredPipeline(
        scheduler=base.scheduler,
        vae=vae,
        text_encoder=base.text_encoder,
        tokenizer=base.tokenizer,
        processor=base.processor,
        transformer=transformer,
    )


def _config(model: Any) -> dict[str, Any]:
    """A model's config as its own arguments (without `_use_default_values`, which would undo what is changed)."""
    return {k: v for k, v in model.config.items() if not k.startswith("_")}
