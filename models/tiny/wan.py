"""Tiny random-weight Wan 2.1 and 2.2 A14B checkpoints (text-to-video and image-to-video), built offline on the
helpers of models/tiny/__init__.py: a UMT5 text encoder on the tiny T5 tokenizer, a 3-level causal video VAE (8x
spatial, 4x temporal compression, 16 latent channels as the real one), a 2-block `WanTransformer3DModel` (two of them
for Wan 2.2 A14B's experts), and the UniPC multistep scheduler in flow-prediction mode as Wan 2.1's checkpoints ship it.
Frames: any 4k + 1; sides: multiples of 16.
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.text import make_t5_tokenizer

# The tiny transformer's width: 2 heads x 12 (Ulysses over 2 ranks splits the heads).
HEADS, HEAD_DIM = 2, 12
TEXT_DIM = 32
# The image-to-video family's CLIP vision tower: its penultimate hidden state conditions every block.
IMAGE_DIM = 24


def umt5_encoder(tok: Any, d_model: int = TEXT_DIM) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return UMT5EncoderModel(config)


def wan_vae() -> Any:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def _vae22() -> Any:
    """Wan 2.2's VAE (TI2V-5B): 48 latent channels, 16x spatial compression (a 2x2 patchify around the 8x
    convolutions, residual down- and up-sampling), 4x temporal."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.1 * ((i % 7) - 3) for i in range(48)],
        latents_std=[1.0 + 0.05 * (i % 5) for i in range(48)],
    )


def wan_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    # Wan 2.1's scheduler_config.json: UniPC in flow-prediction mode with flow sigmas, shift 3.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )


def _transformer(**extra: Any) -> Any:
    import torch
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=extra.pop("in_channels", 16),
        out_channels=extra.pop("out_channels", 16),
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=extra.pop("num_layers", 2),
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **extra,
    )
    # Sharper attention, so that the prompt (cross-attention) and other frames (self-attention) visibly move the
    # output: with plain random weights a wrong prompt changed frames by a few 1/255 only.
    with torch.no_grad():
        for block in transformer.blocks:
            for attn in (block.attn1, block.attn2):
                attn.norm_q.weight.mul_(3.0)
                attn.norm_k.weight.mul_(3.0)
                attn.to_v.weight.mul_(4.0)
    return transformer


# Wan 2.2 A14B's boundaries (its model_index.json): the high-noise expert runs timesteps >= ratio x 1000.
BOUNDARY_T2V, BOUNDARY_I2V = 0.875, 0.9


def build_wan(two_experts: bool = False, layers: int = 2) -> Any:
    """Wan 2.1 T2V; `two_experts`: Wan 2.2 A14B's layout (`transformer_2` and `boundary_ratio`); `layers`: blocks
    per transformer."""
    from diffusers import WanPipeline

    tok = make_t5_tokenizer()
    experts = {"transformer_2": _transformer(num_layers=layers), "boundary_ratio": BOUNDARY_T2V} if two_experts else {}
    return WanPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(tok),
        vae=wan_vae(),
        scheduler=wan_scheduler(),
        transformer=_transformer(num_layers=layers),
        **experts,
    )


def build_wan_ti2v() -> Any:
    """Wan 2.2 TI2V-5B's layout: `expand_timesteps` (a timestep per latent token), Wan 2.2's VAE, a 48-channel
    transformer, no image encoder: text to video, and image to video from the same checkpoint."""
    from diffusers import WanPipeline

    tok = make_t5_tokenizer()
    return WanPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(tok),
        vae=_vae22(),
        scheduler=wan_scheduler(),
        transformer=_transformer(in_channels=48, out_channels=48),
        expand_timesteps=True,
    )


def build_wan_i2v(image_context: bool = True, two_experts: bool = False, image_projections: bool = True) -> Any:
    """Wan 2.1 I2V; `image_context=False`: Wan 2.2 I2V's transformer, without image cross-attention (`image_dim`
    and `added_kv_proj_dim` null), and no image encoder; `two_experts` (with it): Wan 2.2 I2V A14B's layout;
    `image_projections=False`: an image embedding (`image_dim`) without its own key/value projections
    (`added_kv_proj_dim` null), a layout diffusers' pipeline runs and the wan-i2v family does not read."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    tok = make_t5_tokenizer()
    if not image_context:
        experts = {"transformer_2": _transformer(in_channels=36), "boundary_ratio": BOUNDARY_I2V} if two_experts else {}
        return WanImageToVideoPipeline(
            tokenizer=tok,
            text_encoder=umt5_encoder(tok),
            vae=wan_vae(),
            scheduler=wan_scheduler(),
            transformer=_transformer(in_channels=36),
            **experts,
        )
    vision = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=IMAGE_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            projection_dim=IMAGE_DIM,
        )
    )
    processor = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    # Wan 2.1 I2V: 36 input channels (16 noise + 4 mask + 16 first-frame latents) and the image context's own
    # key/value projections in every block.
    projections = {"added_kv_proj_dim": HEADS * HEAD_DIM} if image_projections else {}
    transformer = _transformer(in_channels=36, image_dim=IMAGE_DIM, **projections)
    return WanImageToVideoPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(tok),
        vae=wan_vae(),
        scheduler=wan_scheduler(),
        image_processor=processor,
        image_encoder=vision,
        transformer=transformer,
    )
