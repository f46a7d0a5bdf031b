"""Random-weight checkpoints at a real family's full size, offline (issue 31): the transformer and the VAE with the
configuration the published checkpoint ships, the text encoders tiny, their output widths what the transformer
expects. What loading, resident memory per rank and the time to heal do at real sizes can then be measured on a CPU
(`diffusiond bench load`); no image such a checkpoint makes means anything. The text encoders stay tiny because
they are not what is measured: deployments that share a transformer differ in them, and a T5-XXL would add 9 GB.

    diffusiond make-tiny --family sd35 --real-size --out /tmp/sd35-medium   # 2.24 B parameters in bf16: 4.5 GB
    diffusiond make-tiny --family wan --real-size --out /tmp/wan-1.3b       # Wan 2.1 T2V 1.3B's transformer and VAE
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# stabilityai/stable-diffusion-3.5-medium, transformer/config.json.
SD35_MEDIUM = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "dual_attention_layers": tuple(range(13)),
}
# stabilityai/stable-diffusion-3-medium-diffusers and 3.5's, vae/config.json: 16 latent channels, 8x.
SD3_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json (its VAE is AutoencoderKLWan's defaults).
WAN_1_3B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
REAL_SIZE_FAMILIES = ("sd35", "wan")


def _sd35_medium() -> Any:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    from diffusiond.models.tiny.text import clip_config, make_clip_tokenizer, make_t5_tokenizer, t5_encoder

    tokenizer, tokenizer_2, tokenizer_3 = make_clip_tokenizer(), make_clip_tokenizer(), make_t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**SD35_MEDIUM),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(**SD3_VAE),
        # Pooled: 1024 + 1024 = pooled_projection_dim; T5's width is joint_attention_dim (CLIP's states are padded).
        text_encoder=CLIPTextModelWithProjection(clip_config(tokenizer, projection_dim=1024)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(clip_config(tokenizer_2, projection_dim=1024)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=t5_encoder(tokenizer_3, d_model=4096),
        tokenizer_3=tokenizer_3,
    )


def _wan_1_3b() -> Any:
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from diffusiond.models.tiny.text import make_t5_tokenizer
    from diffusiond.models.tiny.wan import umt5_encoder, wan_scheduler

    tokenizer = make_t5_tokenizer()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=umt5_encoder(tokenizer, d_model=4096),
        transformer=WanTransformer3DModel(**WAN_1_3B),
        vae=AutoencoderKLWan(),
        scheduler=wan_scheduler(),
    )


def build_real_size(family: str, out: str | Path, seed: int = 0) -> Path:
    """Write `family`'s real-size random checkpoint (bf16 safetensors) to `out`; return its path."""
    import torch

    builders = {"sd35": _sd35_medium, "wan": _wan_1_3b}
    if family not in builders:
        raise ValueError(f"--real-size: {family!r} has no real-size layout here; choose from {', '.join(builders)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = builders[family]()
    pipe.to(torch.bfloat16)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
