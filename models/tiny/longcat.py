"""A tiny random-weight LongCat-Image pipeline (`LongCatImagePipeline`), built entirely offline: a Qwen2.5-VL text
encoder (which also rewrites prompts, generating text) with its Qwen2-VL processor (its image processor needs
torchvision), a FLUX-style MMDiT over packed 2x2 latent patches, FLUX's 16-channel VAE layout. It draws from torch's
global RNG, so the caller seeds (and forks) it.

The rewrite's instructions are ~1,600 words: the tokenizer keeps each of them whole, so that its question is ~1,700
tokens instead of ~5,500 spelled out in bytes. A random text encoder's rewrite does not depend on the prompt (the
instructions drown it): tests that need a prompt to matter turn the rewrite off (`enable_prompt_rewrite`).
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.images import flux_scheduler, sd_vae
from diffusiond.models.tiny.qwen import VISION_TOKENS, build_qwenimage, make_qwen_tokenizer, sharpen_text, vl_encoder
from diffusiond.models.tiny.text import WORDS

# The processor's chat template: message contents as a string or as a list of parts (the rewrite's), text parts only.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _words() -> tuple[str, ...]:
    from diffusers.pipelines.longcat_image.system_messages import SYSTEM_PROMPT_EN

    seen = dict.fromkeys(WORDS)
    for word in SYSTEM_PROMPT_EN.split():
        if word.isascii() and word.isalpha():
            seen.setdefault(word)
    return tuple(seen)


def build_longcat_image(num_layers: int = 1, num_single_layers: int = 1) -> Any:
    """`num_layers` double-stream and `num_single_layers` single-stream blocks (the deep cache tests take more)."""
    from diffusers import LongCatImagePipeline, LongCatImageTransformer2DModel

    tokenizer = make_qwen_tokenizer(_words(), special=VISION_TOKENS)
    config = build_qwenimage().text_encoder.config
    config.text_config.max_position_embeddings = 4096  # the rewrite's question and its new tokens
    text_encoder, processor = vl_encoder(config, tokenizer, CHAT_TEMPLATE)
    transformer = LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # == the text encoder's hidden size
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],  # sums to attention_head_dim
    )
    vae = sd_vae(scaling_factor=0.3611, shift_factor=0.1159)  # LongCat-Image decodes with FLUX.1's VAE
    sharpen_text(transformer, vae)
    return LongCatImagePipeline(
        scheduler=flux_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_processor=processor,
        transformer=transformer,
    )


def build_longcat_image_edit(num_layers: int = 1, num_single_layers: int = 1) -> Any:
    """A tiny `LongCatImageEditPipeline`: LongCat-Image's components (the text encoder's vision tower reads the image
    to edit beside the instruction; no rewrite)."""
    from diffusers import LongCatImageEditPipeline

    base = build_longcat_image(num_layers, num_single_layers)
    return LongCatImageEditPipeline(**base.components)
