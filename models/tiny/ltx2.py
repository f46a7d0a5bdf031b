"""Tiny random-weight LTX-2 checkpoints (text-to-video and image-to-video, both with audio), built offline.

`build_ltx2()` constructs every component of `diffusers.LTX2Pipeline` with a tiny config in LTX-2.0's layout (fp32,
CPU), drawing from torch's global RNG, so the caller seeds it; `build_ltx2_i2v()` puts the same components in an
`LTX2ImageToVideoPipeline`. The pipelines save with `save_pretrained` and load back with `from_pretrained`.

- Text: a 2-layer Gemma 3 (`Gemma3ForConditionalGeneration`, with a tiny SigLIP vision tower as the real one has) read
  through an in-memory `GemmaTokenizer`: byte-fallback BPE over text whose spaces are normalized to "▁", every word of
  `tiny.WORDS` one token (bare, and after "▁" mid-sentence). The pipeline stacks all 3 hidden states per token.
- Connectors (`LTX2TextConnectors`): the projection of the stacked hidden states and one 1D transformer layer per
  modality, with 8 learnable registers that replace the padding (so `max_sequence_length` must be a multiple of 8).
- Transformer (`LTX2VideoTransformer3DModel`): 2 audio-video blocks, video 2 heads x 16, audio 2 heads x 8, with
  perturbable self-attention (STG).
- Video VAE (`AutoencoderKLLTX2Video`): the real layout (4x4 patches, spatial / temporal / 2 spatiotemporal down
  blocks, 3 spatiotemporal residual up blocks): 32x spatial and 8x temporal compression, 16 latent channels.
  Frames: any 8k + 1; sides: multiples of 32 (the pipeline checks), at least 64 (the decoder's reflect padding
  needs 2 latent pixels, as in the real VAE).
- Audio VAE (`AutoencoderKLLTX2Audio`): 16 mel bins of stereo audio at 16 kHz (hop 160), 4x compressed in time and
  mel, 2 latent channels; vocoder (`LTX2Vocoder`): 240x upsampling (the real factors) to 24 kHz stereo.
- Scheduler: flow-match Euler with LTX's resolution-dependent shift.
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.text import WORDS, add_merges

_SPACE = "▁"  # Gemma's normalizer replaces " " with it
_PAD, _EOS, _BOS, _UNK, _MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
# Gemma 3's image markers; the text-only prompt path never emits them, the multimodal model's config names them.
_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")

TEXT_DIM = 32  # Gemma hidden size == the connectors' width == the transformer's caption_channels
TEXT_LAYERS = 2  # the pipeline stacks all TEXT_LAYERS + 1 hidden states
REGISTERS = 8  # learnable registers per connector; the padded prompt length must be a multiple
VIDEO_HEADS, VIDEO_HEAD_DIM = 2, 16
AUDIO_HEADS, AUDIO_HEAD_DIM = 2, 8  # the a2v / v2a cross-attention ropes need AUDIO_HEADS == VIDEO_HEADS
LATENT_CHANNELS = 16
MEL_BINS, AUDIO_LATENT_CHANNELS = 16, 2  # packed audio token: 2 channels x 16 / 4 latent mel bins = 8 features


# --------------------------------------------------------------------------------------------------- tokenizer


def make_gemma_tokenizer(words: tuple[str, ...] = WORDS) -> Any:
    """A `GemmaTokenizer` (byte-fallback BPE, left padding, `<bos>` prepended) with one token per listed word, bare
    and "▁"-prefixed (raises if it splits one). The vocabulary: Gemma's special tokens first (`<pad>`=0, `<eos>`=1,
    `<bos>`=2, `<unk>`=3, `<mask>`=4), the image markers, the 256 `<0xNN>` byte-fallback tokens, "▁" and printable
    ASCII, then merge results. Merges are made as in `tiny.clip_vocab_and_merges`; since "▁" only ever starts a
    merged symbol, no merge crosses a word boundary.
    """
    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {}
    for token in (_PAD, _EOS, _BOS, _UNK, _MASK, *_IMAGE_TOKENS):
        vocab[token] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in [_SPACE, *(chr(i) for i in range(ord("!"), ord("~") + 1))]:
        vocab[c] = len(vocab)
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):
        for symbols in ([*word], [_SPACE, *word]):
            add_merges(symbols, vocab, merges, ranks)
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=_UNK,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        mask_token=_MASK,
        extra_special_tokens=list(_IMAGE_TOKENS),
        add_bos_token=True,  # as Gemma's tokenizer.json: `<bos>` starts every prompt
        model_max_length=1024,
    )
    got = tok([" ".join(words)])["input_ids"][0]
    want = [vocab[_BOS], vocab[words[0]], *(vocab[_SPACE + w] for w in words[1:])]
    if got != want:
        raise RuntimeError(f"tiny Gemma tokenizer splits listed words: {tok.decode(got[:40])}")
    return tok


# --------------------------------------------------------------------------------------------------- components


def _text_encoder(tok: Any) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in _IMAGE_TOKENS}
    config = Gemma3Config(
        text_config=Gemma3TextConfig(
            vocab_size=len(tok),
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,  # the real model's: its head_dim
            max_position_embeddings=2048,
            sliding_window=512,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
        ),
        vision_config=SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,  # 4x4 patches pooled 2x2
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    return Gemma3ForConditionalGeneration(config)


def _connectors() -> Any:
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors(
        caption_channels=TEXT_DIM,
        text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=TEXT_DIM // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=REGISTERS,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=TEXT_DIM // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=REGISTERS,
        connector_rope_base_seq_len=4096,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_temporal_positioning=False,
        rope_type="split",
    )


def _transformer() -> Any:
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    transformer = LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=VIDEO_HEADS,
        attention_head_dim=VIDEO_HEAD_DIM,
        cross_attention_dim=VIDEO_HEADS * VIDEO_HEAD_DIM,  # the caption projection's output: the video width
        vae_scale_factors=(8, 32, 32),
        audio_in_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,
        audio_out_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,
        audio_num_attention_heads=AUDIO_HEADS,
        audio_attention_head_dim=AUDIO_HEAD_DIM,
        audio_cross_attention_dim=AUDIO_HEADS * AUDIO_HEAD_DIM,
        audio_scale_factor=4,
        audio_sampling_rate=16000,
        audio_hop_length=160,
        num_layers=2,
        caption_channels=TEXT_DIM,
        rope_type="split",
        perturbed_attn=True,  # self-attention that spatio-temporal guidance can perturb (its blocks, `stg_blocks`)
    )
    # The padded prompt is 1024 tokens by default, all but a few of them the connectors' registers, and random
    # cross-attention spreads over them evenly: another prompt moved the 64x64 frames by 0.0035 of 1 and the audio by
    # 0.001, a guidance of 5 instead of 3 the frames by 0.0013. Sharper cross-attention with stronger text values
    # make them visible (prompt: frames 0.26, audio 0.09; guidance: frames 0.16).
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for attn in (block.attn2, block.audio_attn2):
                attn.norm_q.weight.mul_(3.0)
                attn.norm_k.weight.mul_(3.0)
                attn.to_v.weight.mul_(4.0)
    return transformer


def _vae() -> Any:
    import torch
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(8, 16, 32, 32),
        decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        spatial_compression_ratio=32,  # as the real config states: the default formula would give 64 and 16
        temporal_compression_ratio=8,
    )
    # Per-channel latent statistics (the real VAE has them), so that (de)normalization is exercised.
    with torch.no_grad():
        vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, LATENT_CHANNELS))
        vae.latents_std.copy_(torch.linspace(0.8, 1.2, LATENT_CHANNELS))
    return vae


def _audio_vae() -> Any:
    import torch
    from diffusers import AutoencoderKLLTX2Audio

    packed = AUDIO_LATENT_CHANNELS * MEL_BINS // 4
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=packed,  # its latent statistics have `base_channels` entries: one per packed audio feature
        output_channels=2,
        ch_mult=(1, 2, 4),  # two 2x up/downsamples: the fixed 4x time and mel compression
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=256,
        latent_channels=AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=MEL_BINS,
    )
    with torch.no_grad():
        audio_vae.latents_mean.copy_(torch.linspace(-0.1, 0.1, packed))
        audio_vae.latents_std.copy_(torch.linspace(0.9, 1.1, packed))
    return audio_vae


def _vocoder() -> Any:
    import torch
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    vocoder = LTX2Vocoder(
        in_channels=2 * MEL_BINS,  # stereo mel channels x mel bins
        hidden_channels=64,  # halved by each of the 5 upsamplers
        out_channels=2,
        upsample_kernel_sizes=[16, 15, 8, 4, 4],
        upsample_factors=[6, 5, 2, 2, 2],  # 240 samples per 10 ms mel frame: 24 kHz
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=24000,
    )
    # Default-initialized, each of its 37 convolutions shrinks its input, so the waveform was the output bias (a
    # constant +-0.22 per channel) with 0.003 of signal, and another seed moved it by 0.0002. Twice the weights and
    # no output bias carry the spectrogram through: std 0.17 over time, unsaturated by the final tanh.
    with torch.no_grad():
        for module in vocoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.weight.mul_(2.0)
        vocoder.conv_out.bias.zero_()
    return vocoder


def _scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # LTX-Video's schedule: the exponential shift mu grows with the number of video tokens (0.95 at 1024, 2.05 at
    # 4096; the pipeline extrapolates below) and the sigmas are stretched to end at 0.1 before the final 0.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )


def _components() -> dict[str, Any]:
    tokenizer = make_gemma_tokenizer()
    return {
        "scheduler": _scheduler(),
        "vae": _vae(),
        "audio_vae": _audio_vae(),
        "text_encoder": _text_encoder(tokenizer),
        "tokenizer": tokenizer,
        "connectors": _connectors(),
        "transformer": _transformer(),
        "vocoder": _vocoder(),
    }


# --------------------------------------------------------------------------------------------------- pipelines


def build_ltx2() -> Any:
    """A tiny `LTX2Pipeline` (text to video with audio)."""
    from diffusers import LTX2Pipeline

    return LTX2Pipeline(**_components())


def build_ltx2_i2v() -> Any:
    """A tiny `LTX2ImageToVideoPipeline`: the same components; the image is the first latent frame, kept clean."""
    from diffusers import LTX2ImageToVideoPipeline

    return LTX2ImageToVideoPipeline(**_components())
