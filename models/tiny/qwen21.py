"""A tiny random-weight Qwen-Image 2.1 pipeline, built entirely offline.

`build_qwenimage21()` constructs every component of `QwenImage21Pipeline` with a tiny config (fp32, CPU), drawing
from torch's global RNG (the caller seeds it): a Qwen3-VL text encoder with a one-block vision tower, read through a
`Qwen3VLProcessor`; the single-stream block-causal transformer with `causal_condition` (so the pipeline's prefix
KV cache is used, as with the real checkpoint); the 16x-compressing, 64-channel RGBA VAE; a dynamically shifted
flow-matching scheduler. It saves with `save_pretrained`, loads back with `QwenImage21Pipeline.from_pretrained`, and
generates a 64x64 image in 4 steps well under a second on a CPU, from a prompt alone or with condition images
(the pipeline resizes a condition image to `output_resolution` squared pixels, 1024x1024 unless told otherwise:
about 1.5 s here, 0.05 s with `output_resolution=64`).

The tokenizer is tiny_qwen's byte-level BPE with the Qwen2-VL vision markers and the words of the pipeline's system
prompt; the pipeline drops that system message's tokens as its chat template renders them here.
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.qwen import VISION_TOKENS, make_qwen_tokenizer
from diffusiond.models.tiny.text import WORDS

# The words of the pipeline's system prompt ("Comprehend and analyze the provided prompt.") that WORDS lacks.
_SYSTEM_WORDS: tuple[str, ...] = ("Comprehend", "analyze", "provided", "prompt")

# Qwen3-VL's ChatML layout over message parts, as its real template renders them: a message's text parts in order,
# an image or video part as its vision markers. The pipeline renders only the system message through it (to count
# the tokens it drops); its prompts are raw template strings.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_qwenimage21() -> Any:
    """A tiny `QwenImage21Pipeline` (Qwen-Image 2.1): Qwen3-VL text encoder and processor, two-block single-stream
    transformer with `causal_condition`, 64-channel RGBA VAE with the real latent statistics."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = make_qwen_tokenizer(WORDS + _SYSTEM_WORDS, special=VISION_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "max_position_embeddings": 4096,
                # Interleaved M-RoPE; the sections sum to head_dim / 2, roughly the real model's 24:20:20.
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5000000.0,
                    "mrope_section": [4, 2, 2],
                    "mrope_interleaved": True,
                },
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 32,  # == text hidden_size
                "num_position_embeddings": 64,  # an 8x8 grid, interpolated to the image's
                "deepstack_visual_indexes": [0],  # the one block also feeds the first text layer, as deepstack does
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    )
    # Qwen3-VL's processor: 16-pixel patches merged 2x2, so one image slot per 32x32 pixels, i.e. per 2x2 latent
    # tokens of the 16x VAE (the transformer's `img_mask` slots). Qwen3-VL's default smallest image (256x256) would
    # give a smaller condition image more slots than it has latents; 32x32 lets any multiple of 32 through unscaled.
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            patch_size=16,
            temporal_patch_size=2,
            merge_size=2,
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            size={"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096},
        ),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=64,  # == the VAE's z_dim, unpatched
        out_channels=64,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=32,  # == text hidden_size
        mlp_ratio=3,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim, in the real (16, 56, 56) proportion
        causal_condition=True,  # the default, which the pipeline's prefix KV cache (use_kv_cache=True) requires
    )
    # Four downsamples (len(dim_mult) - 1), as the pipeline's fixed vae_scale_factor = 16 requires; z_dim and the
    # latent statistics stay the real model's (the defaults: 64 values each). Four channels in and out: RGBA.
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=64,
        dim_mult=[1, 2, 4, 8, 8],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
    )
    # The pipeline passes its own sigmas and a `mu` from calculate_shift, reading base/max_image_seq_len and
    # base/max_shift from this config (defaults 256/4096/0.5/1.15 if absent), so shifting must be dynamic. The values
    # are Qwen-Image's scheduler's: the 2.1 checkpoint's own scheduler config is not available offline.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    # With plain random weights a prompt, true CFG or another condition image moved a 64x64 image by only 0.002,
    # 0.005 and 0.0003 of 1: the shared modulation's tanh gates are small (attention barely reaches the residual
    # stream), attention is nearly uniform, and the random VAE encoder maps different images to almost the same
    # latents (0.014 apart after the latent statistics). Larger gates, sharper attention, stronger values and a
    # louder encoder mean make them 0.08-0.12, 0.26-0.29 and 0.05-0.08 (over four seeds).
    with torch.no_grad():
        transformer.modulation[1].weight.mul_(8.0)
        for block in transformer.transformer_blocks:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_k.weight.mul_(3.0)
            block.attn.to_v.weight.mul_(2.0)
        z_dim = vae.config.z_dim  # quant_conv's first z_dim outputs are the mean, what the pipeline encodes with
        vae.quant_conv.weight[:z_dim].mul_(10.0)
        vae.quant_conv.bias[:z_dim].mul_(10.0)
    pipe = QwenImage21Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor, transformer=transformer
    )
    # The dropped system message must be exactly the prompt templates' first tokens, or prompt tokens are lost.
    system = pipe.prompt_template_t2i.split("<|im_start|>user")[0]
    n, drop = len(tokenizer(system)["input_ids"]), pipe._drop_idx
    if n != drop:
        raise RuntimeError(f"the Qwen-Image 2.1 system message is {n} tokens, the pipeline drops {drop}")
    return pipe
