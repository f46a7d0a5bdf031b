"""A tiny random-weight Kandinsky 6 (`Kandinsky6TI2VAPipeline`: text or image to video with sound), built offline. It
has no dedicated family: the generic path serves it (models/generic/), its frames and sound as its call returns
them."""

from __future__ import annotations


def build_kandinsky6():
    """Kandinsky 6 (`Kandinsky6TI2VAPipeline`): video with sound at toy size. A Qwen2.5-VL text encoder and processor
    (its last hidden state past the template's first 129 tokens), a CLIP text encoder (pooled), one fused video/audio
    transformer, HunyuanVideo's causal video VAE (8x spatial, 4x temporal), MMAudio's mel VAE and vocoder."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        Kandinsky6TI2VAPipeline,
        Kandinsky6Transformer3DModel,
        MMAudioVAE,
        MMAudioVocoder,
    )
    from transformers import (
        CLIPTextModel,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from diffusiond.models.tiny.qwen import VISION_TOKENS, make_qwen_tokenizer
    from diffusiond.models.tiny.text import WORDS, clip_config, make_clip_tokenizer

    tokenizer = make_qwen_tokenizer(WORDS, special=VISION_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 4096,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                "pad_token_id": tokenizer.pad_token_id,
                "bos_token_id": tokenizer.eos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 32,
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )
    clip_tokenizer = make_clip_tokenizer()
    clip = CLIPTextModel(clip_config(clip_tokenizer))
    transformer = Kandinsky6Transformer3DModel(
        in_visual_dim=16,
        out_visual_dim=16,
        in_text_dim=32,
        in_text_dim2=32,
        time_dim=32,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),
        visual_cond=True,
        in_audio_dim=8,
        out_audio_dim=8,
        text_token_padding=True,
        ca_rope=True,
        cross_gates=True,
        fix_modulation=True,
        visual_token_type_num_embeddings=2,  # image conditioning (the first frame) needs it, as released ones set it
    )
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=16,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
    )
    audio_vae = MMAudioVAE(
        mel_bins=16,
        latent_channels=8,
        hidden_channels=16,
        channel_multipliers=(1, 2),
        layers_per_block=1,
        sample_rate=8000,  # the lowest rate AAC (the MP4's sound track) takes
        n_fft=64,
        hop_length=16,
    )
    vocoder = MMAudioVocoder(
        num_mels=16,
        upsample_initial_channel=16,
        upsample_rates=(4, 4),
        upsample_kernel_sizes=(8, 8),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 3, 5),),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return Kandinsky6TI2VAPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        text_encoder_2=clip,
        tokenizer_2=clip_tokenizer,
        scheduler=scheduler,
        audio_vae=audio_vae,
        vocoder=vocoder,
    )
