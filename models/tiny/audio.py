"""A tiny random-weight Stable Audio Open (`StableAudioPipeline`: the reference design's audio row), built offline,
served by its family (models/families/stable_audio.py) or, with `--adapter generic`, the generic path. Its scheduler
(cosine DPM-Solver) needs torchsde, as the real checkpoint's does."""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.text import make_t5_tokenizer, t5_encoder

# The tiny Oobleck VAE's samples per second and the waveform's channels.
AUDIO_SAMPLE_RATE = 64
AUDIO_CHANNELS = 2


def build_stable_audio() -> Any:
    """Stable Audio Open's layout at toy size: a T5 text encoder and a projection of its embedding with the clip's
    start and end seconds, a DiT over latent frames, an Oobleck VAE (stereo, a 4x downsampling), the cosine DPM-Solver
    scheduler in v-prediction."""
    import torch
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )

    tokenizer = make_t5_tokenizer()
    text_encoder = t5_encoder(tokenizer, d_model=32)
    transformer = StableAudioDiTModel(
        sample_size=16,  # latent frames of the longest clip: 16 x 4 samples / 64 per second = 1 s
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_attention_heads=1,
        out_channels=4,
        cross_attention_dim=16,
        time_proj_dim=16,
        global_states_input_dim=32,
        cross_attention_input_dim=16,
    )
    vae = AutoencoderOobleck(
        encoder_hidden_size=8,
        downsampling_ratios=[2, 2],
        decoder_channels=8,
        decoder_input_channels=4,
        audio_channels=AUDIO_CHANNELS,
        channel_multiples=[1, 2],
        sampling_rate=AUDIO_SAMPLE_RATE,
    )
    projection = StableAudioProjectionModel(
        text_encoder_dim=text_encoder.config.d_model, conditioning_dim=16, min_value=0, max_value=512
    )
    scheduler = CosineDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    with torch.no_grad():  # cross-attention sharpened, so that a prompt changes the sound clearly
        for block in transformer.transformer_blocks:
            block.attn2.to_q.weight.mul_(4.0)
            block.attn2.to_k.weight.mul_(4.0)
            block.attn2.to_v.weight.mul_(4.0)
    return StableAudioPipeline(
        vae=vae,
        text_encoder=text_encoder,
        projection_model=projection,
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=scheduler,
    )
