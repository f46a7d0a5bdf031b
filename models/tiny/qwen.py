"""Tiny random-weight Z-Image and Qwen-Image pipelines, built entirely offline.

`build_zimage()` and `build_qwenimage()` construct every component of `ZImagePipeline` / `QwenImagePipeline` with a
tiny config (fp32, CPU); they draw from torch's global RNG, so the caller seeds (and forks) it. The pipelines save
with `save_pretrained` and load back with `DiffusionPipeline.from_pretrained`, and generate a 64x64 image in 4 steps
in well under a second on a CPU.

Both families read prompts with a Qwen tokenizer (`Qwen2Tokenizer`: GPT-2 style byte-level BPE, no end-of-word
suffix). It is built in memory from the same word list as the tiny CLIP/T5 tokenizers: every listed word is one
token both bare and after the byte-level space symbol "Ġ" (as it appears mid-sentence), and all 256 byte symbols are
in the vocabulary, so any other text still tokenizes. The words of the chat roles and of Qwen-Image's system prompt
are added, so that the prompt template the Qwen-Image pipeline cuts off (its first 34 tokens, counted with the real
Qwen tokenizer) is exactly 34 tokens here too.
"""

from __future__ import annotations

from typing import Any

from diffusiond.models.tiny.images import sd_vae
from diffusiond.models.tiny.text import WORDS, add_merges, bytes_to_unicode

_SPACE = "Ġ"  # byte-level symbol of " "
_EOT = "<|endoftext|>"
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"

# Chat roles, and the words of QwenImagePipeline.prompt_template_encode that WORDS lacks (case matters: Qwen does not
# lower-case its input).
_TEMPLATE_WORDS: tuple[str, ...] = (
    "system",
    "user",
    "assistant",
    "Describe",
    "detailing",
    "size",
    "quantity",
    "spatial",
    "relationships",
    "objects",
)

# Qwen's ChatML layout. Z-Image renders a user message with add_generation_prompt=True and enable_thinking=True,
# for which the real Qwen3 template adds nothing more than this.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# --------------------------------------------------------------------------------------------------- tokenizer


def qwen_vocab_and_merges(words: tuple[str, ...] = WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary in which each of `words` and `"Ġ" + word` is one token.

    The 256 byte symbols come first, then merge results. Merges are made as in `tiny.clip_vocab_and_merges`: each
    spelling is first split with the merges so far and its remaining pieces joined left to right by new,
    lower-priority merges, which never changes how an earlier spelling splits.
    """
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):
        for symbols in ([*word], [_SPACE, *word]):
            add_merges(symbols, vocab, merges, ranks)
    return vocab, merges


def make_qwen_tokenizer(words: tuple[str, ...] = WORDS, special: tuple[str, ...] = ()) -> Any:
    """A `Qwen2Tokenizer` with one token per listed word (bare and "Ġ"-prefixed; raises if it splits one), plus the
    chat-role and Qwen-Image template words, `<|endoftext|>` (pad/eos), `<|im_start|>`, `<|im_end|>` and a ChatML
    chat template.

    Built from in-memory `vocab=dict, merges=list[tuple]`: under transformers v5, `Qwen2Tokenizer(vocab_file=...,
    merges_file=...)` silently yields a tokenizer that maps every text to no ids at all.
    """
    from transformers import Qwen2Tokenizer

    words = tuple(dict.fromkeys(words + _TEMPLATE_WORDS))
    vocab, merges = qwen_vocab_and_merges(words)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=_EOT,
        eos_token=_EOT,
        pad_token=_EOT,
        extra_special_tokens=[_IM_START, _IM_END, *special],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    # Contractions ("'s") are split off before BPE, never after a space: only their bare form is one token.
    spaced = [w for w in words if not w.startswith("'")]
    got = tok([*words, *(" " + w for w in spaced)])["input_ids"]
    want = [[vocab[w]] for w in words] + [[vocab[_SPACE + w]] for w in spaced]
    bad = [ids for ids, expect in zip(got, want, strict=True) if ids != expect]
    if bad:
        raise RuntimeError(f"tiny Qwen tokenizer splits listed words: {tok.batch_decode(bad[:10])}")
    return tok


# --------------------------------------------------------------------------------------------------- pipelines


def build_zimage(n_layers: int = 2) -> Any:
    """A tiny `ZImagePipeline`: Qwen3 text encoder, single-stream DiT (`n_layers` main layers), FLUX-style
    16-channel VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = make_qwen_tokenizer()
    text_encoder = qwen3_encoder(tokenizer)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=48,  # its feed-forward's hidden size, int(dim / 3 * 8) = 128, splits over --tp 2 (32's, 85, would not)
        n_layers=n_layers,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,  # == text encoder hidden_size
        axes_dims=[8, 8, 8],  # sums to the head dim, dim / n_heads
        axes_lens=[1024, 512, 512],
    )
    vae = sd_vae(scaling_factor=0.3611, shift_factor=0.1159)  # the real Z-Image VAE is FLUX's
    # Z-Image-Turbo's scheduler: a fixed shift, though the pipeline computes (and the scheduler then ignores) a mu.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    # No weights need scaling up (unlike Qwen-Image): the caption tokens, padded to 32, share a single attention with
    # the image tokens, so prompt and guidance already change a 64x64 image by more than 0.1.
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def build_qwenimage(num_layers: int = 2, axes_dims_rope: tuple[int, int, int] = (4, 6, 6)) -> Any:
    """A tiny `QwenImagePipeline`: Qwen2.5-VL text encoder (with a tiny vision tower), MMDiT (`num_layers` blocks;
    its rotary axes summing to its head dim, 16), Qwen-Image VAE."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = make_qwen_tokenizer()
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            # Sums to head_dim / 2, in the real model's 16:24:24 proportion.
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,  # == text hidden_size
            "fullatt_block_indexes": [0],
        },
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # == text hidden_size
        axes_dims_rope=axes_dims_rope,  # sums to attention_head_dim
    )
    # Three downsamples, so vae_scale_factor = 8; latents_mean/std keep the real model's (the defaults).
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
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
    sharpen_text(transformer, vae)
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    # The pipeline drops the template's first tokens as counted by the real tokenizer; they must be exactly the
    # template here too, or prompt tokens are lost.
    prefix = pipe.prompt_template_encode.split("{}")[0]
    n, drop = len(tokenizer(prefix)["input_ids"]), pipe.prompt_template_encode_start_idx
    if n != drop:
        raise RuntimeError(f"the Qwen-Image prompt template prefix is {n} tokens, the pipeline drops {drop}")
    return pipe


# Qwen2-VL's vision markers, and the words of the Qwen-Image-Edit prompt template that WORDS lacks: its prefix (the
# pipeline drops its first 64 tokens, counted with the real tokenizer) is 64 tokens here too.
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
_EDIT_WORDS: tuple[str, ...] = (
    "key", "features", "input", "color", "texture", "background", "then", "explain", "how", "text", "instruction",
    "should", "alter", "modify", "Generate", "new", "meets", "requirements", "while", "maintaining", "consistency",
    "original", "where", "appropriate", "Picture", "(", "),", "'s",
)  # fmt: skip


def build_qwenimage_edit_plus(zero_cond_t: bool = False, plus: bool = True) -> Any:
    """A tiny `QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509; `zero_cond_t`: 2511's layout; `plus=False`: the
    first release's `QwenImageEditPipeline`, the same components): Qwen-Image's components, a Qwen2.5-VL text
    encoder whose vision tower reads the edit's images (Qwen2-VL processor: 14-pixel patches merged 2x2), and the
    vision markers in the tokenizer."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    base = build_qwenimage()
    tokenizer = make_qwen_tokenizer(WORDS + _EDIT_WORDS, special=VISION_TOKENS)
    text_encoder, processor = vl_encoder(base.text_encoder.config, tokenizer, CHAT_TEMPLATE)
    transformer = base.transformer
    if zero_cond_t:
        transformer.register_to_config(zero_cond_t=True)
        transformer.zero_cond_t = True
        for block in transformer.transformer_blocks:
            block.zero_cond_t = True
    pipe = (QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)(
        scheduler=base.scheduler,
        vae=base.vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    # The first release's template has the image's markers before the prompt; the dropped part ends before them.
    prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
    n, drop = len(tokenizer(prefix)["input_ids"]), pipe.prompt_template_encode_start_idx
    if n != drop:
        raise RuntimeError(f"the Qwen-Image-Edit prompt template prefix is {n} tokens, the pipeline drops {drop}")
    return pipe


def qwen3_encoder(tokenizer: Any) -> Any:
    """A tiny Qwen3 text model over `tokenizer` (hidden size 32), as Z-Image and Ovis-Image read prompts."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def vl_encoder(config: Any, tokenizer: Any, chat_template: str) -> tuple[Any, Any]:
    """A tiny Qwen2.5-VL text encoder of `config` (a tiny Qwen-Image's) over `tokenizer`, with its vision markers,
    and its Qwen2-VL processor (14-pixel patches merged 2x2; needs torchvision)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=chat_template,
    )
    return text_encoder, processor


def sharpen_text(transformer: Any, vae: Any) -> None:
    """With plain random weights the text barely reaches the image (another prompt or guidance scale moves pixels by
    ~5/255) and the decoder paints a flat gray: sharpen the image-to-text attention of the double-stream blocks,
    amplify the text values and give the decoded image contrast (Qwen-Image, Ovis-Image, LongCat-Image)."""
    import torch

    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_added_k.weight.mul_(3.0)
            block.attn.add_v_proj.weight.mul_(4.0)
        vae.decoder.conv_out.weight.mul_(2.0)


def _flux2_parts(guidance_embeds: bool) -> tuple[Any, Any, Any]:
    """FLUX.2's tiny transformer (one double- and one single-stream block, 4-axis rotary ids, sharpened attention),
    its 32-channel VAE with batch-norm statistics, and its scheduler."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,  # 32 latent channels in 2x2 patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # 3 hidden layers x 16
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to the head dim
        guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=32, norm_num_groups=4, sample_size=256
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    # With plain random weights a prompt moves a 64x64 image by 0.02 of 1 (512 padded text tokens dilute the
    # attention); sharper attention makes a wrong prompt or guidance clearly visible.
    with torch.no_grad():
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_k.weight.mul_(3.0)
    return transformer, vae, scheduler


def build_flux2klein() -> Any:
    """A tiny `Flux2KleinPipeline` (FLUX.2 [klein]): a 27-layer Qwen3 causal LM (the pipeline reads hidden layers 9,
    18 and 27), a FLUX.2 double- and single-stream block with 4-axis rotary ids, a 32-channel FLUX.2 VAE with its
    batch-norm statistics, CFG enabled (not distilled)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = make_qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=27,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    transformer, vae, scheduler = _flux2_parts(guidance_embeds=False)
    return Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )


# Mistral Small 3.1's instruction markers, image markers and `<s>`; a Mistral-style template over the pipeline's
# message parts (system text, then the user's text).
_MISTRAL_TOKENS = (
    "<s>",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
_MISTRAL_TEMPLATE = (
    "<s>"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}{%- else %}{{- '[INST]' }}{%- endif %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if message['role'] == 'system' %}{{- '[/SYSTEM_PROMPT]' }}{%- else %}{{- '[/INST]' }}{%- endif %}"
    "{%- endfor %}"
)


def build_flux2dev() -> Any:
    """A tiny `Flux2Pipeline` (FLUX.2 [dev]): a 30-layer Mistral-3 text encoder with a Pixtral vision tower (the
    pipeline reads hidden layers 10, 20 and 30 of its language model, after a system message), read through a
    `PixtralProcessor`; FLUX.2's transformer with the guidance embedding (guidance-distilled: one row per request)
    and the FLUX.2 VAE, as `build_flux2klein`."""
    import re

    import torch
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    words = WORDS + tuple(dict.fromkeys(re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)))
    tokenizer = make_qwen_tokenizer(words, special=_MISTRAL_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _MISTRAL_TOKENS}
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=MistralConfig(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=30,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=1024,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=ids["<s>"],
                eos_token_id=tokenizer.eos_token_id,
            ),
            vision_config=PixtralVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=8,
                patch_size=14,
                image_size=224,
            ),
            image_token_index=ids["[IMG]"],
            spatial_merge_size=2,
        )
    )
    # Random tiny layers without q/k norms attend almost uniformly, so every token's hidden state is nearly the same
    # mix of the system message: a prompt moved a 64x64 image by 0.003 of 1. Sharper attention and larger
    # embeddings keep the prompt visible (0.013).
    with torch.no_grad():
        for layer in text_encoder.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
        text_encoder.get_input_embeddings().weight.mul_(20.0)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=14),
        tokenizer=tokenizer,
        patch_size=14,
        spatial_merge_size=2,
        chat_template=_MISTRAL_TEMPLATE,
    )
    transformer, vae, scheduler = _flux2_parts(guidance_embeds=True)
    return Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor, transformer=transformer
    )
