"""A tiny random-weight FLUX.3 [klein] as diffusers' Modular pipeline (`Flux3ModularPipeline`, its `Flux3AutoBlocks`),
built entirely offline.

`build_flux3klein()` constructs every component the auto blocks expect with a tiny config (fp32, CPU), drawing from
torch's global RNG (the caller seeds it): the prompt upsampler, a Qwen3.5 vision-language model (three linear-attention
layers and one full-attention layer, as Qwen3.5 interleaves them, and a one-block vision tower) read through a
`Qwen3VLProcessor` over a `Qwen3_5Tokenizer`, as transformers pairs them; the text encoder, a Qwen3-VL model with 32
hidden layers (the text encoder step stacks layers 4, 8, ..., 32 by default) read through a `Qwen3VLProcessor` over
a `Qwen2Tokenizer`; FLUX.2's 32-channel VAE; the FLUX.3 transformer; the scheduler, guider and image processor the
blocks declare (their `ComponentSpec`s). `build_tiny` saves it with its components beside `modular_model_index.json`.

Both tokenizers are tiny_qwen's byte-level BPE over the shared word list plus the words of the upsampler's
text-to-image system prompt (else that prompt spells out in pieces: 1,887 tokens instead of 764), with the ChatML,
vision and thinking markers. The upsampler generates greedily until its end token or `max_new_tokens` (3584 by
default): a random model rambles (it ended after 449 to 2,232 tokens for the prompts tried, 1-10 s here), so callers
that want it quick pass a small `max_new_tokens`.
"""

from __future__ import annotations

import re
from typing import Any

from diffusiond.models.tiny.qwen import qwen_vocab_and_merges
from diffusiond.models.tiny.text import WORDS

_EOT = "<|endoftext|>"
_IM_END = "<|im_end|>"
SPECIAL_TOKENS = (
    "<|im_start|>",
    _IM_END,
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
)

# Qwen's ChatML over a message's content given as a string (the text encoder step) or as a list of parts (the
# upsampler: its system prompt, the request, reference images); `enable_thinking=False` opens the answer with an
# empty thinking block, as Qwen3.5's own template does.
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
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Prompts whose few-token captions the builder checks are non-empty (the upsampler step raises on an empty one).
_CHECKED_PROMPTS = ("a red circle", "a cat", "an old castle on a hill at sunset", "x")


def _words() -> tuple[str, ...]:
    from diffusers.modular_pipelines.flux3.prompt_upsampler import SYSTEM_PROMPTS

    system = re.findall(r"[A-Za-z]+", SYSTEM_PROMPTS["t2i"])
    return tuple(dict.fromkeys((*WORDS, *system, "system", "user", "assistant")))


def make_tokenizer(cls: Any, words: tuple[str, ...]) -> Any:
    """A byte-level BPE tokenizer of class `cls` (`Qwen2Tokenizer`, `Qwen3_5Tokenizer`) with one token per listed
    word, bare and after a space (raises if it splits one), `<|im_end|>` as its end and `<|endoftext|>` as padding,
    and `SPECIAL_TOKENS`."""
    vocab, merges = qwen_vocab_and_merges(words)
    tok = cls(
        vocab=vocab,
        merges=merges,
        unk_token=_EOT,
        eos_token=_IM_END,
        pad_token=_EOT,
        extra_special_tokens=list(SPECIAL_TOKENS),
        model_max_length=262144,
    )
    got = tok([*words, *(" " + w for w in words)])["input_ids"]
    want = [[vocab[w]] for w in words] + [[vocab["Ġ" + w]] for w in words]
    bad = [ids for ids, expect in zip(got, want, strict=True) if ids != expect]
    if bad:
        raise RuntimeError(f"tiny {cls.__name__} splits listed words: {tok.batch_decode(bad[:10])}")
    return tok


def make_processor(tokenizer: Any) -> Any:
    """A `Qwen3VLProcessor` (what `AutoProcessor` gives for Qwen3-VL and Qwen3.5): 16-pixel patches merged 2x2."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
        ),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )


def _vision_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _vision_config(out_hidden_size: int) -> dict[str, Any]:
    return {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out_hidden_size,  # == text hidden_size
        "num_position_embeddings": 64,
    }


def build_upsampler(tokenizer: Any) -> Any:
    """The prompt upsampler: a tiny `Qwen3_5ForConditionalGeneration`, four text layers in Qwen3.5's 3:1 pattern of
    linear (gated delta rule) and full attention."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "max_position_embeddings": 8192,  # the 780-token system prompt and 3584 new tokens
                # A quarter of the head dim rotates (8); the sections sum to half of it.
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
                "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config=_vision_config(32),
            **_vision_ids(tokenizer),
        )
    )
    # With plain random weights the 764-token system prompt drowns the request: 14 prompts got one caption. Sharper
    # full attention (its norms are zero-centred: weight 3 scales by 4) and slowly decaying linear-attention state
    # give them 8.
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.q_norm.weight.fill_(3.0)
                layer.self_attn.k_norm.weight.fill_(3.0)
            else:
                layer.linear_attn.A_log.fill_(-5.0)
    return model


def build_text_encoder(tokenizer: Any, hidden_size: int = 16) -> Any:
    """The text encoder: a tiny `Qwen3VLForConditionalGeneration` with 32 hidden layers, the deepest the text
    encoder step reads by default."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": hidden_size,
                "intermediate_size": 2 * hidden_size,
                "num_hidden_layers": 32,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "max_position_embeddings": 8192,
                # Interleaved M-RoPE; the sections sum to head_dim / 2.
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5000000.0,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
                "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={**_vision_config(hidden_size), "deepstack_visual_indexes": [0]},
            **_vision_ids(tokenizer),
        )
    )


def build_transformer(text_hidden_size: int, layers: int = 8) -> Any:
    """A tiny `Flux3Transformer2DModel`: one per-mode block per token mode and one joint single block; its text input
    is `layers` stacked hidden states of the text encoder."""
    import torch
    from diffusers import Flux3Transformer2DModel

    transformer = Flux3Transformer2DModel(
        in_channels=128,  # 32 latent channels in 2x2 patches
        cond_in_channels=128,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=layers * text_hidden_size,
        timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # (t, h, w, l), summing to the head dim
    )
    # With plain random weights another caption moved a 64x64 image by at most 0.03 of 1, a negative prompt by 0.02:
    # the modulation's gates are small and attention over the 80 padded text tokens nearly uniform. Larger gates and
    # sharper attention make that 0.15 and 0.24.
    with torch.no_grad():
        for modulation in (
            *transformer.early_stream_modulations.values(),
            *transformer.single_stream_modulations.values(),
        ):
            modulation.linear.weight.mul_(4.0)
        for name, weight in transformer.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight")):
                weight.mul_(3.0)
    return transformer


def build_flux3klein() -> Any:
    """A tiny FLUX.3 [klein] `Flux3ModularPipeline` with every component of `Flux3AutoBlocks`."""
    from diffusers import AutoencoderKLFlux2
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3AutoBlocks
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    words = _words()
    upsampler_processor = make_processor(make_tokenizer(Qwen3_5Tokenizer, words))
    tokenizer = make_processor(make_tokenizer(Qwen2Tokenizer, words))
    text_encoder = build_text_encoder(tokenizer.tokenizer)
    components = {
        "prompt_upsampler": build_upsampler(upsampler_processor.tokenizer),
        "prompt_upsampler_processor": upsampler_processor,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": build_transformer(text_encoder.config.text_config.hidden_size),
        # FLUX.2's VAE: 8x spatial, 32 latent channels (128 once packed 2x2).
        "vae": AutoencoderKLFlux2(
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=1,
            latent_channels=32,
            norm_num_groups=4,
            sample_size=256,
        ),
    }
    blocks = Flux3AutoBlocks()
    # The scheduler (shift 6.93), guider (CFG 3.5) and image processor as the blocks declare them.
    for spec in blocks.expected_components:
        if spec.name not in components and spec.default_creation_method == "from_config":
            components[spec.name] = spec.create()
    pipe = blocks.init_pipeline()
    pipe.update_components(**components)
    _check_captions(pipe)
    return pipe


def _check_captions(pipe: Any) -> None:
    """The upsampler's greedy few-token captions of ordinary prompts are not empty."""
    from diffusers.modular_pipelines.flux3.prompt_upsampler import upsample_prompt

    for prompt in _CHECKED_PROMPTS:
        upsample_prompt(pipe.prompt_upsampler, pipe.prompt_upsampler_processor, prompt, max_new_tokens=4)
