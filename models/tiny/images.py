"""Tiny random-weight SD3, SD3.5, SDXL, FLUX.1 and FLUX.1 Kontext pipelines, built offline (models/tiny/ writes them
with the pipeline's own `save_pretrained`)."""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.text import clip_config, make_clip_tokenizer, make_t5_tokenizer, t5_encoder


def sd_vae(scaling_factor: float, shift_factor: float, **config: Any) -> Any:
    """`config`: further AutoencoderKL arguments (GLM-Image's per-channel latent statistics)."""
    from diffusers import AutoencoderKL

    # Four blocks, so vae_scale_factor = 2 ** (4 - 1) = 8 as in the real SD3/FLUX VAEs; 16 latent channels.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        act_fn="silu",
        latent_channels=16,
        norm_num_groups=4,
        sample_size=256,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        **config,
    )


def build_sd3(num_layers: int = 2, **layout: Any) -> Any:
    """`layout`: the transformer arguments that set SD3.5 apart (RMS q/k norms, dual attention layers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=64,
        **layout,
    )
    vae = sd_vae(scaling_factor=1.5305, shift_factor=0.0609)
    tokenizer = make_clip_tokenizer()
    tokenizer_2 = make_clip_tokenizer()
    text_encoder = CLIPTextModelWithProjection(clip_config(tokenizer, projection_dim=32))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(tokenizer_2, projection_dim=32))
    tokenizer_3 = make_t5_tokenizer()
    text_encoder_3 = t5_encoder(tokenizer_3, d_model=64)  # d_model == joint_attention_dim
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def flux_scheduler() -> Any:
    """FLUX.1's flow-matching scheduler, its shift computed from the image's length (also Ovis-Image's and
    LongCat-Image's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        shift=3.0,
    )


def build_flux(pipeline: str = "FluxPipeline", num_layers: int = 1, num_single_layers: int = 1) -> Any:
    """`pipeline`: FluxPipeline, or FluxKontextPipeline (the same components)."""
    import diffusers
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # == T5 d_model
        pooled_projection_dim=32,  # == CLIP hidden_size
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = sd_vae(scaling_factor=0.3611, shift_factor=0.1159)
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModel(clip_config(tokenizer))
    tokenizer_2 = make_t5_tokenizer()
    text_encoder_2 = t5_encoder(tokenizer_2, d_model=32)
    scheduler = flux_scheduler()
    return getattr(diffusers, pipeline)(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def build_sdxl() -> Any:
    """SDXL's layout at toy size: a two-level UNet with cross-attention and "text_time" added conditioning (6 size
    ids x 8 + the 32-dim pooled projection of the second CLIP), two CLIP encoders whose hidden states concatenate to
    the UNet's 64-dim cross-attention, a 4-channel VAE with SDXL's scaling factor, and SDXL base's Euler scheduler."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    unet = UNet2DConditionModel(
        sample_size=8,  # the pipeline's default size: 8 x vae_scale_factor = 64
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=256,
        scaling_factor=0.13025,
        force_upcast=False,
    )
    tokenizer = make_clip_tokenizer()
    tokenizer_2 = make_clip_tokenizer()
    text_encoder = CLIPTextModel(clip_config(tokenizer))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(tokenizer_2, projection_dim=32))
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
    )


def build_kontext() -> Any:
    """FLUX's tiny components as a FluxKontextPipeline, with sharper attention: with plain random weights the image
    tokens reach the output through near-uniform attention only (another input image moved pixels by 0.002 of 1;
    with q/k norms x3 and values x4, by 0.04)."""
    import torch

    pipe = build_flux("FluxKontextPipeline")
    with torch.no_grad():
        for block in [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_k.weight.mul_(3.0)
            block.attn.to_v.weight.mul_(4.0)
    return pipe


def build_sd15() -> Any:
    """Stable Diffusion 1.5's layout at toy size: a two-level UNet with cross-attention over one CLIP encoder's hidden
    states, a 4-channel VAE with SD 1.5's scaling factor, SD 1.5's PNDM scheduler (`skip_prk_steps`: a call of N steps
    runs N + 1 timesteps), no safety checker. The cross-attention's queries and keys are scaled up so that prompts
    change the image clearly (random weights attend almost uniformly)."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    unet = UNet2DConditionModel(
        sample_size=8,  # the pipeline's default size: 8 x vae_scale_factor = 64
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        cross_attention_dim=32,  # == CLIP hidden_size
        norm_num_groups=8,
    )
    with torch.no_grad():
        for name, module in unet.named_modules():
            if name.endswith("attn2"):
                module.to_q.weight.mul_(3.0)
                module.to_k.weight.mul_(3.0)
                module.to_v.weight.mul_(3.0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=256,
        scaling_factor=0.18215,
    )
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModel(clip_config(tokenizer))
    scheduler = PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        skip_prk_steps=True,
        steps_offset=1,
        set_alpha_to_one=False,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_flux_modular() -> Any:
    """FLUX.1's tiny components as a Modular pipeline (`FluxModularPipeline`, its auto blocks): what the generic path
    serves through its denoise loop (models/generic/loading.py)."""
    from diffusers.modular_pipelines.flux.modular_blocks_flux import FluxAutoBlocks

    blocks = FluxAutoBlocks()
    pipe = blocks.init_pipeline()
    wanted = {c.name for c in blocks.expected_components}
    pipe.update_components(**{k: v for k, v in build_flux().components.items() if k in wanted})
    return pipe
