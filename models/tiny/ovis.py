"""A tiny random-weight Ovis-Image pipeline (`OvisImagePipeline`), built entirely offline: a Qwen3 text encoder read
through the chat template (the tiny Qwen tokenizer of models/tiny/qwen.py), a FLUX-style MMDiT over packed 2x2
latent patches, FLUX's 16-channel VAE layout. It draws from torch's global RNG, so the caller seeds (and forks) it.
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.images import flux_scheduler, sd_vae
from diffusiond.models.tiny.qwen import make_qwen_tokenizer, qwen3_encoder, sharpen_text


def build_ovis_image(num_layers: int = 1, num_single_layers: int = 1) -> Any:
    """`num_layers` double-stream and `num_single_layers` single-stream blocks (the deep cache tests take more)."""
    from diffusers import OvisImagePipeline, OvisImageTransformer2DModel

    tokenizer = make_qwen_tokenizer()
    text_encoder = qwen3_encoder(tokenizer)
    transformer = OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        out_channels=64,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # == the text encoder's hidden size
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = sd_vae(scaling_factor=0.3611, shift_factor=0.1159)  # Ovis-Image decodes with FLUX.1's VAE
    # Plain random weights: another prompt moved pixels by 0.005, under the tests' 100x tolerance.
    sharpen_text(transformer, vae)
    return OvisImagePipeline(
        scheduler=flux_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
