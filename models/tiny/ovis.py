"""A tiny random-weight Ovis-Image pipeline (`OvisImagePipeline`), built entirely offline: a Qwen3 text encoder read
through the chat template (the tiny Qwen tokenizer of models/tiny/qwen.py), a FLUX-style MMDiT over packed 2x2
latent patches, FLUX's 16-channel VAE layout. It draws from torch's global RNG, so the caller seeds (and forks) it.
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.images import sd_vae
from diffusiond.models.tiny.qwen import make_qwen_tokenizer

# Ovis-Image's system prompt, in words the tiny tokenizer keeps whole.
_SYSTEM_WORDS = ("Describe", "the", "image", "by", "detailing", "color", "quantity", "text", "shape", "size")


def build_ovis_image(num_layers: int = 1, num_single_layers: int = 1) -> Any:
    """`num_layers` double-stream and `num_single_layers` single-stream blocks (the deep cache tests take more)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, OvisImagePipeline, OvisImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = make_qwen_tokenizer()
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
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
    # With plain random weights the text barely reaches the image (another prompt moved pixels by 0.005): sharper
    # attention to the text's keys and larger text values, so that prompt, negative prompt and guidance each change a
    # 64x64 image by more than the tests' 100x tolerance.
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_added_k.weight.mul_(3.0)
            block.attn.add_v_proj.weight.mul_(4.0)
        vae.decoder.conv_out.weight.mul_(2.0)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        shift=3.0,
    )
    return OvisImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
