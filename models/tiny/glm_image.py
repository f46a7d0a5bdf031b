"""A tiny random-weight GLM-Image pipeline (`GlmImagePipeline`), built entirely offline: the autoregressive prior (a
tiny `GlmImageForConditionalGeneration`: text model, vision tower, VQ codebook) read through a `GlmImageProcessor`
over the tiny byte-level BPE tokenizer, a ByT5 glyph encoder (a tiny T5 over the byte-level `ByT5Tokenizer`), the
DiT and a 16-channel VAE with per-channel latent statistics. It draws from torch's global RNG, so the caller seeds
(and forks) it.

The prior's sampled tokens index the DiT's prior embedding directly, so the DiT's codebook covers the prior's whole
vision vocabulary (a random prior samples any of them), and the prior's end token lies outside it (never sampled:
every call generates the full grid, as the pipeline expects).
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.images import sd_vae
from diffusiond.models.tiny.qwen import qwen_vocab_and_merges
from diffusiond.models.tiny.text import WORDS, t5_encoder

_EOT = "<|endoftext|>"
# The processor's named tokens (`GlmImageProcessor` reads them off the tokenizer) and the chat roles.
_NAMED = {
    "image_token": "<|image|>",
    "grid_bos_token": "<sop>",
    "grid_eos_token": "<eop>",
}
_BOS = "<|dit_token_16384|>"  # where the prior's image tokens start
_ROLES = ("<|user|>", "<|assistant|>", "<|begin_of_image|>", "<|end_of_image|>")
# GLM's chat layout: the user's images and text, then the assistant's turn (the processor appends the grids).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|user|>\n"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}<|assistant|>\n"
)
VISION_VOCAB = 80  # the prior's output vocabulary: the DiT's codebook too
TEXT_DIM = 32  # the glyph encoder's width (the DiT's `text_embed_dim`)


def make_glm_tokenizer() -> Any:
    """A byte-level BPE tokenizer with one token per listed word, the processor's named tokens and GLM's roles."""
    from transformers import Qwen2Tokenizer

    vocab, merges = qwen_vocab_and_merges(WORDS)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=_EOT,
        eos_token=_EOT,
        pad_token=_EOT,
        bos_token=_BOS,
        extra_special_tokens={**_NAMED, **{f"role_{i}": t for i, t in enumerate(_ROLES)}},
        model_max_length=32768,
    )


def _prior(tokenizer: Any) -> Any:
    import torch
    from transformers import GenerationConfig, GlmImageConfig, GlmImageForConditionalGeneration

    never = len(tokenizer)  # an id past the prior's vision vocabulary: generation never ends early
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(tokenizer) + 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vision_vocab_size": VISION_VOCAB,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": never,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 16,
            "image_size": 256,
        },
        vq_config={"embed_dim": 8, "num_embeddings": VISION_VOCAB - 16, "latent_channels": 16},
        image_token_id=tokenizer.convert_tokens_to_ids(_NAMED["image_token"]),
        image_start_token_id=tokenizer.convert_tokens_to_ids("<|begin_of_image|>"),
        image_end_token_id=tokenizer.convert_tokens_to_ids("<|end_of_image|>"),
    )
    model = GlmImageForConditionalGeneration(config)
    # Plain random logits are near uniform: the sampled tokens then follow the seed's draws, whatever the prompt.
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config = GenerationConfig(
        eos_token_id=never, pad_token_id=tokenizer.pad_token_id, do_sample=True, top_k=0
    )
    return model


def build_glm_image(num_layers: int = 2) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from transformers import ByT5Tokenizer, GlmImageImageProcessor, GlmImageProcessor

    tokenizer = make_glm_tokenizer()
    processor = GlmImageProcessor(
        image_processor=GlmImageImageProcessor(patch_size=16, merge_size=1, temporal_patch_size=1),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    byt5 = ByT5Tokenizer()
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=4,
        text_embed_dim=TEXT_DIM,
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=VISION_VOCAB,
    )
    # The SD3/FLUX-style tiny VAE (16 channels, 8x) with per-channel statistics, which GLM-Image's pipeline reads
    # instead of a scaling and shift factor.
    vae = sd_vae(
        1.0, 0.0, latents_mean=[0.05 * (i - 8) for i in range(16)], latents_std=[1.0 + 0.1 * i for i in range(16)]
    )
    return GlmImagePipeline(
        tokenizer=byt5,
        processor=processor,
        text_encoder=t5_encoder(byt5, TEXT_DIM),
        vision_language_encoder=_prior(tokenizer),
        vae=vae,
        transformer=transformer,
        # GLM-Image's schedule: its size shift linear in the square root of the tokens (CogView4's).
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.25, max_shift=0.75, time_shift_type="linear", use_dynamic_shifting=True
        ),
    )
