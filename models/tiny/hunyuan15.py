"""Tiny random-weight HunyuanVideo-1.5 checkpoints (text-to-video and image-to-video), built offline.

`build_hunyuan_video15()` constructs every component of `diffusers.HunyuanVideo15Pipeline` with a tiny config in the
480p checkpoints' layout (fp32, CPU), drawing from torch's global RNG, so the caller seeds it;
`build_hunyuan_video15_i2v()` builds a `HunyuanVideo15ImageToVideoPipeline` (its transformer marked `task_type="i2v"`,
plus the SigLIP image encoder and its processor). The pipelines save with `save_pretrained` and load back with
`from_pretrained`.

- Text: a 3-layer Qwen2.5-VL language model (`Qwen2_5_VLTextModel`; the pipeline reads its third-to-last hidden state)
  read through an in-memory `Qwen2Tokenizer` (`tiny_qwen`'s: every word of `tiny.WORDS` one token), right-padded to
  108 + 1000 tokens. The pipeline drops the first 108 tokens (the system message's chat prefix, counted with the real
  tokenizer): the system message's words and its runs of 8 spaces are single tokens here, so the prefix is exactly
  108 tokens too (checked at build time).
- Glyph text: a 2-layer ByT5 encoder (`T5EncoderModel` over the byte-level `ByT5Tokenizer`, with a few of the real
  checkpoint's added color / font tokens), run only on the "quoted" parts of a prompt (256 tokens); prompts without
  quotes give zero embeddings, fully masked.
- Image (i2v only): a 1-layer SigLIP vision tower (`SiglipVisionModel`, 384 px in 14 px patches: 729 tokens, as the
  real so400m encoder and the t2v pipeline's zero image embeddings) and its `SiglipImageProcessor` (needs
  torchvision, as transformers' image processors do).
- Transformer (`HunyuanVideo15Transformer3DModel`): 2 dual-stream blocks of 2 heads x 16 and 1 token-refiner block;
  input: noise, condition latents and a mask channel (2 x 8 + 1 = 17 channels), 1x1 patches. `target_size=64` sets
  the default size: t2v without height/width gives 48x80 (16:9's bucket), i2v resizes the image to its bucket at
  that target (a square image: 64x64).
- VAE (`AutoencoderKLHunyuanVideo15`): the real 5-level layout at channels (8, 16, 16, 32, 32), one resnet per level,
  16x spatial and 4x temporal compression, 8 latent channels, the real scaling factor. Frames: any 4k + 1; sides:
  multiples of 16 (one latent pixel is enough: the causal convolutions pad by replication). Its mid-block attention
  mask broadcasts wrongly for more than one video (diffusers 0.42): decode a batch with `pipe.vae.enable_slicing()`.
- Scheduler: flow-match Euler with the 480p checkpoints' fixed shift 5 (the pipeline passes its own linear sigmas);
  guider: `ClassifierFreeGuidance(guidance_scale=6.0)`, as the real (undistilled) checkpoints. The guidance scale is
  the guider's, not a call argument: `pipe.guider = pipe.guider.new(guidance_scale=...)`; it runs the transformer
  once for the prompt and once for the negative prompt (" " by default), never both in one batch.
- Batches: rows are independent (per-row timesteps and text masks), but t2v's zero image embeddings have one row
  per prompt, so `num_videos_per_prompt` > 1 fails there.
"""

from __future__ import annotations

import re
from typing import Any

from diffusiond.models.tiny.qwen import (
    _EOT,
    _IM_END,
    _IM_START,
    _SPACE,
    _TEMPLATE_WORDS,
    CHAT_TEMPLATE,
    qwen_vocab_and_merges,
)
from diffusiond.models.tiny.text import WORDS, t5_encoder

TEXT_DIM = 32  # Qwen hidden size == the transformer's text_embed_dim
BYT5_DIM = 32  # ByT5 d_model == text_embed_2_dim
IMAGE_DIM = 32  # SigLIP hidden size == image_embed_dim
HEADS, HEAD_DIM = 2, 16
LATENT_CHANNELS = 8
TARGET_SIZE = 64
# The real ByT5 (Glyph-SDXL-v2) has added color and multilingual font tokens; a few keep that layout.
_GLYPH_TOKENS = ("<color-0>", "<color-1>", "<color-2>", "<en-font-0>", "<en-font-1>", "<zh-font-0>")


# --------------------------------------------------------------------------------------------------- tokenizers


def _system_message() -> str:
    """The pipelines' system message (a default of their prompt encoder)."""
    from diffusers import HunyuanVideo15Pipeline

    return next(d for d in HunyuanVideo15Pipeline._get_mllm_prompt_embeds.__defaults__ if isinstance(d, str))


def make_hunyuan_tokenizer() -> Any:
    """`tiny_qwen`'s Qwen tokenizer, plus the system message's words and one token for a run of 8 spaces (each of
    the message's numbered lines starts with 9: as the real tokenizer, 8 spaces, then " " and the digit), so that the
    chat prefix the pipeline drops is exactly its 108 tokens. Right padding, as the real checkpoint's."""
    from transformers import Qwen2Tokenizer

    system = _system_message()
    words = tuple(dict.fromkeys(WORDS + _TEMPLATE_WORDS + tuple(re.findall(r"[A-Za-z]+", system))))
    vocab, merges = qwen_vocab_and_merges(words)
    # Whitespace runs merge pairwise (2, 4, 8 spaces), so 8 spaces are one token, fewer several.
    for n in (1, 2, 4):
        pair = (_SPACE * n, _SPACE * n)
        if pair not in merges:
            merges.append(pair)
        vocab.setdefault(_SPACE * 2 * n, len(vocab))
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=_EOT,
        eos_token=_EOT,
        pad_token=_EOT,
        extra_special_tokens=[_IM_START, _IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        padding_side="right",
    )
    got = tok([" ".join(words)])["input_ids"][0]
    want = [vocab[words[0]], *(vocab[_SPACE + w] for w in words[1:])]
    if got != want:
        raise RuntimeError(f"tiny Qwen tokenizer splits listed words: {tok.decode(got[:40])}")
    return tok


def _check_prefix(pipe: Any) -> None:
    """Raise unless the chat prefix the pipeline drops (its first `prompt_template_encode_start_idx` tokens, counted
    with the real tokenizer) is exactly that many tokens here too."""
    chat = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "{}"}]
    prefix = pipe.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).split("{}")[0]
    n, drop = len(pipe.tokenizer(prefix)["input_ids"]), pipe.prompt_template_encode_start_idx
    if n != drop:
        raise RuntimeError(f"the HunyuanVideo-1.5 chat prefix is {n} tokens, the pipeline drops {drop}")


def make_byt5_tokenizer() -> Any:
    """The byte-level `ByT5Tokenizer` (3 specials, 256 bytes, 125 sentinels) with a few added glyph tokens."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    tok.add_tokens(list(_GLYPH_TOKENS), special_tokens=True)
    return tok


# --------------------------------------------------------------------------------------------------- components


def _text_encoder(tok: Any) -> Any:
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tok),
        hidden_size=TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=3,  # the pipeline reads hidden_states[-3]: the first layer's output
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        # Sums to head_dim / 2, in the real model's 16:24:24 proportion.
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return Qwen2_5_VLTextModel(config)


def _image_encoder() -> tuple[Any, Any]:
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=IMAGE_DIM,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=384,
            patch_size=14,  # 27 x 27 = 729 tokens, the pipeline's `vision_num_semantic_tokens`
        )
    )
    processor = SiglipImageProcessor(size={"height": 384, "width": 384})
    return encoder, processor


def _transformer(task_type: str) -> Any:
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1,  # noise, condition latents, condition mask
        out_channels=LATENT_CHANNELS,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=BYT5_DIM,
        image_embed_dim=IMAGE_DIM,
        rope_theta=256.0,
        rope_axes_dim=(4, 6, 6),  # sums to the head dim, in the real (16, 56, 56)'s rough proportion
        target_size=TARGET_SIZE,
        task_type=task_type,
        use_meanflow=False,
    )
    # With plain random weights the text barely reaches the video: a short prompt's ~10 valid tokens (of 1000 + 256
    # glyph + 729 image slots, the rest masked) mix evenly with the video tokens in the joint attention, so another
    # prompt moved the 64x64 frames (9 frames, 3 steps) by 0.026 of 1, a guidance of 3 instead of 6 by 0.026, and in
    # i2v (the 729 SigLIP tokens valid too) by 0.005 and 0.004. Sharper video-to-text attention and stronger text
    # values make them visible: t2v prompt 0.10, guidance 0.08 (1, i.e. no CFG: 0.13), a quoted glyph text 0.75;
    # i2v prompt 0.09, guidance 0.08, a blue image instead of a red one 0.59; another seed 0.88.
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_added_k.weight.mul_(3.0)
            block.attn.add_v_proj.weight.mul_(8.0)
    return transformer


def _vae() -> Any:
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(8, 16, 16, 32, 32),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
        scaling_factor=1.03682,  # the real VAE's
    )


def _components(task_type: str) -> dict[str, Any]:
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    tokenizer = make_hunyuan_tokenizer()
    tokenizer_2 = make_byt5_tokenizer()
    return {
        "text_encoder": _text_encoder(tokenizer),
        "tokenizer": tokenizer,
        "transformer": _transformer(task_type),
        "vae": _vae(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
        "text_encoder_2": t5_encoder(tokenizer_2, d_model=BYT5_DIM),
        "tokenizer_2": tokenizer_2,
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }


# --------------------------------------------------------------------------------------------------- pipelines


def _finish(pipe: Any) -> Any:
    """Check the chat prefix; put every model in eval mode, as `from_pretrained` loads them (T5's dropout would
    otherwise make the in-memory pipeline differ from the saved one)."""
    import torch

    _check_prefix(pipe)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def build_hunyuan_video15() -> Any:
    """A tiny `HunyuanVideo15Pipeline` (text to video)."""
    from diffusers import HunyuanVideo15Pipeline

    return _finish(HunyuanVideo15Pipeline(**_components("t2v")))


def build_hunyuan_video15_i2v() -> Any:
    """A tiny `HunyuanVideo15ImageToVideoPipeline`: the image is encoded by the VAE as the first latent frame's
    condition (mask 1 there) and by SigLIP into 729 tokens the transformer attends to."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    components = _components("i2v")
    components["image_encoder"], components["feature_extractor"] = _image_encoder()
    return _finish(HunyuanVideo15ImageToVideoPipeline(**components))
