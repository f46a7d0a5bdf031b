"""Tiny random-weight SD3 and FLUX checkpoints, built entirely offline.

`build_tiny(family, out)` constructs every pipeline component with a tiny config under a fixed seed and writes a
diffusers checkpoint folder with the pipeline's own `save_pretrained`, so `model_index.json` and each component's
config are exactly what diffusers writes for a real checkpoint. The folder loads back with
`StableDiffusion3Pipeline.from_pretrained(out)` / `FluxPipeline.from_pretrained(out)` and generates (noise-like)
images at any height/width that is a multiple of 16 (SD3: up to 1024, as pos_embed_max_size=64 allows), in
well under a second at 256x256 on a CPU.

The tokenizers are built from a fixed list of a few hundred common English words: every listed word is one token,
and any other text still tokenizes through single-character fallback tokens (CLIP: the 256 byte-level symbols, with
and without the `</w>` end-of-word suffix; T5: "▁" plus printable ASCII characters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES: tuple[str, ...] = (
    "sd3",
    "sd35",
    "sdxl",
    "flux",
    "flux-kontext",
    "flux2-klein",
    "flux2",
    "z-image",
    "qwen-image",
    "qwen-image-edit",
    "qwen-image-edit-plus",
    "qwen-image-21",
    "wan",
    "wan-i2v",
    "wan22",
    "wan22-i2v",
    "wan22-ti2v",
    "ltx2",
    "ltx2-i2v",
    "hunyuan-video-15",
    "hunyuan-video-15-i2v",
)

# Common English words, plus colours, shapes, animals and photo vocabulary; each becomes a single token in both the
# CLIP and the T5 tokenizer. Lower case ASCII letters only (CLIP lower-cases its input).
_WORD_TEXT = """
    a an the of on in at to by for with from and or but not no is are was be it its this that these those there
    here what which who how very more most some many much few all each every one two three four five six seven
    eight nine ten photo photograph picture image painting drawing sketch illustration render portrait landscape
    close up view top side front back left right center middle above below under over near far behind between
    inside outside background foreground scene style art artwork detailed realistic abstract simple beautiful cute
    small big large tiny huge tall short long wide thin thick old new young bright dark light soft hard shiny
    smooth rough round flat sharp high low quality best masterpiece cinematic lighting sunset sunrise night day
    morning evening sky sun moon star stars cloud clouds rain snow fog storm wind water sea ocean lake river beach
    sand mountain mountains hill forest tree trees flower flowers grass leaf leaves rock stone field garden park
    city street road house building tower bridge castle church room window door wall floor table chair bed car bus
    train boat ship plane bicycle cat cats dog dogs bird birds fish horse cow sheep pig rabbit mouse lion tiger
    bear fox wolf deer monkey elephant giraffe zebra duck owl frog snake butterfly man woman boy girl child people
    person face eyes hair hand hands smile smiling wearing hat shirt dress coat shoes glasses sitting standing
    walking running flying swimming playing holding looking red orange yellow green blue purple pink brown black
    white gray grey gold golden silver colorful colourful color colour circle square triangle rectangle shape
    shapes line lines dot dots stripe stripes pattern grid cube sphere ball box cup bowl plate bottle book lamp
    clock apple banana cake bread pizza coffee tea fire smoke glass metal wood wooden paper plastic robot computer
    phone camera toy flag sign text letter word space planet earth galaxy neon lights reflection shadow shadows
    texture oil watercolor pencil cartoon anime digital vintage retro modern futuristic fantasy magic dream happy
    sad calm quiet empty full alone together
"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512

_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
_EOW = "</w>"


# --------------------------------------------------------------------------------------------------- tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level mapping: each of the 256 bytes to a printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Greedy BPE as the `tokenizers` library applies it: repeatedly merge the lowest-ranked adjacent pair,
    leftmost first."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def add_merges(
    symbols: list[str], vocab: dict[str, int], merges: list[tuple[str, str]], ranks: dict[tuple[str, str], int]
) -> None:
    """Make `symbols` one token: split with the merges so far, then join the remaining pieces left to right by new,
    lower-priority merges (added to `merges`, `ranks` and `vocab`)."""
    pieces = _bpe(symbols, ranks)
    while len(pieces) > 1:
        pair = (pieces[0], pieces[1])
        if pair not in ranks:
            ranks[pair] = len(merges)
            merges.append(pair)
        merged = pair[0] + pair[1]
        vocab.setdefault(merged, len(vocab))
        pieces = [merged, *pieces[2:]]


def clip_vocab_and_merges(words: tuple[str, ...] = WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP BPE vocabulary in which every word of `words` is a single `word</w>` token.

    Layout follows the real CLIP vocabulary: the 256 byte symbols, the same with `</w>`, then merge results, then
    `<|startoftext|>` and `<|endoftext|>` last. Merges are added word by word: the word is first split with the
    merges so far, and the remaining pieces are joined left to right by new, lower-priority merges. Since earlier
    words always have a higher-priority merge available until they are whole, new merges never change how an
    earlier word splits (a merge list made per word in isolation does: "or" from "orange" would break "forest").
    """
    byte_symbols = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for s in byte_symbols:
        vocab[s] = len(vocab)
    for s in byte_symbols:
        vocab[s + _EOW] = len(vocab)
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):
        add_merges([*word[:-1], word[-1] + _EOW], vocab, merges, ranks)
    vocab[_BOS] = len(vocab)
    vocab[_EOS] = len(vocab)
    return vocab, merges


def make_clip_tokenizer(words: tuple[str, ...] = WORDS, max_length: int = CLIP_MAX_LENGTH) -> Any:
    """A CLIPTokenizer with one token per listed word (raises if it splits one), `max_length` tokens of context.

    Built from in-memory `vocab=dict, merges=list[tuple]`: under transformers v5, `CLIPTokenizer(vocab_file=...,
    merges_file=...)` silently yields a tokenizer that maps text to garbage ids.
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges(words)
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=_EOS,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_EOS,
        model_max_length=max_length,
    )
    _check_single_tokens(tok, words, lambda w: [vocab[w + _EOW]], bos=[tok.bos_token_id], eos=[tok.eos_token_id])
    return tok


def t5_vocab(words: tuple[str, ...] = WORDS) -> list[tuple[str, float]]:
    """A Unigram vocabulary: `<pad>`=0, `</s>`=1, `<unk>`=2, then "▁word" pieces (preferred: one piece scores
    far better than spelling a word out), then "▁" and printable ASCII characters as the fallback."""
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("▁" + w, -5.0 - i * 1e-3) for i, w in enumerate(dict.fromkeys(words))]
    vocab.append(("▁", -8.0))
    vocab += [(chr(c), -10.0) for c in range(ord("!"), ord("~") + 1)]
    return vocab


def make_t5_tokenizer(words: tuple[str, ...] = WORDS) -> Any:
    """A T5 tokenizer (`T5TokenizerFast`, an alias of `T5Tokenizer` in transformers v5) with one piece per word."""
    from transformers import T5TokenizerFast

    vocab = t5_vocab(words)
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)
    ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    _check_single_tokens(tok, words, lambda w: [ids["▁" + w]], bos=[], eos=[tok.eos_token_id])
    return tok


def _check_single_tokens(tok: Any, words: tuple[str, ...], expect: Any, *, bos: list[int], eos: list[int]) -> None:
    got = tok(list(words))["input_ids"]
    bad = [w for w, ids in zip(words, got, strict=True) if ids != bos + expect(w) + eos]
    if bad:
        raise RuntimeError(f"tiny tokenizer {type(tok).__name__} splits listed words: {bad[:10]}")


# --------------------------------------------------------------------------------------------------- components


def _vae(scaling_factor: float, shift_factor: float) -> Any:
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
    )


def _clip_config(tok: Any, *, projection_dim: int | None = None) -> Any:
    from transformers import CLIPTextConfig

    # vocab_size and the special ids must match the tokenizer: CLIP pools the hidden state at the first
    # eos_token_id position (legacy argmax pooling only when eos_token_id == 2).
    kwargs: dict[str, Any] = {}
    if projection_dim is not None:
        kwargs["projection_dim"] = projection_dim
    return CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="gelu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )


def _t5(tok: Any, d_model: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=16,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return T5EncoderModel(config)


def _build_sd3(num_layers: int = 2, **layout: Any) -> Any:
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
    vae = _vae(scaling_factor=1.5305, shift_factor=0.0609)
    tokenizer = make_clip_tokenizer()
    tokenizer_2 = make_clip_tokenizer()
    text_encoder = CLIPTextModelWithProjection(_clip_config(tokenizer, projection_dim=32))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2, projection_dim=32))
    tokenizer_3 = make_t5_tokenizer()
    text_encoder_3 = _t5(tokenizer_3, d_model=64)  # d_model == joint_attention_dim
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


def _build_flux(pipeline: str = "FluxPipeline", num_layers: int = 1, num_single_layers: int = 1) -> Any:
    """`pipeline`: FluxPipeline, or FluxKontextPipeline (the same components)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
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
    vae = _vae(scaling_factor=0.3611, shift_factor=0.1159)
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    tokenizer_2 = make_t5_tokenizer()
    text_encoder_2 = _t5(tokenizer_2, d_model=32)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        shift=3.0,
    )
    return getattr(diffusers, pipeline)(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def _build_sdxl() -> Any:
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
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2, projection_dim=32))
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


def _build_kontext() -> Any:
    """FLUX's tiny components as a FluxKontextPipeline, with sharper attention: with plain random weights the image
    tokens reach the output through near-uniform attention only (another input image moved pixels by 0.002 of 1;
    with q/k norms x3 and values x4, by 0.04)."""
    import torch

    pipe = _build_flux("FluxKontextPipeline")
    with torch.no_grad():
        for block in [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]:
            block.attn.norm_q.weight.mul_(3.0)
            block.attn.norm_k.weight.mul_(3.0)
            block.attn.to_v.weight.mul_(4.0)
    return pipe


def build_tiny_pipeline(family: str, seed: int = 0) -> Any:
    """The tiny pipeline for `family`, in memory (fp32, CPU). Same weights as `build_tiny` writes."""
    import torch

    from diffusiond.models import (  # they build on this module's helpers
        tiny_hunyuan15,
        tiny_ltx2,
        tiny_qwen,
        tiny_qwen21,
        tiny_video,
    )

    builders = {
        "sd3": _build_sd3,
        # SD3.5 Medium's layout: RMS-normed q/k and a second (self-only) attention in the first layers.
        "sd35": lambda: _build_sd3(qk_norm="rms_norm", dual_attention_layers=(0,)),
        "sdxl": _build_sdxl,
        "flux": _build_flux,
        "flux-kontext": _build_kontext,
        "z-image": tiny_qwen.build_zimage,
        "qwen-image": tiny_qwen.build_qwenimage,
        # Qwen-Image-Edit and -2509's layouts (need torchvision, for their Qwen2-VL processor).
        "qwen-image-edit": lambda: tiny_qwen.build_qwenimage_edit_plus(plus=False),
        "qwen-image-edit-plus": tiny_qwen.build_qwenimage_edit_plus,
        "flux2-klein": tiny_qwen.build_flux2klein,
        # Qwen-Image 2.1: a Qwen3-VL text encoder (its processor needs torchvision), an RGBA VAE.
        "qwen-image-21": tiny_qwen21.build_qwenimage21,
        # FLUX.2 [dev]: a Mistral-3 text encoder read through a Pixtral processor (needs torchvision).
        "flux2": tiny_qwen.build_flux2dev,
        "wan": tiny_video.build_wan,
        "wan-i2v": tiny_video.build_wan_i2v,
        # Wan 2.2 A14B: two experts (`transformer_2`, `boundary_ratio`); its I2V without image cross-attention.
        "wan22": lambda: tiny_video.build_wan(two_experts=True),
        "wan22-i2v": lambda: tiny_video.build_wan_i2v(image_context=False, two_experts=True),
        # Wan 2.2 TI2V-5B: text and image to video from one checkpoint (`expand_timesteps`, Wan 2.2's VAE).
        "wan22-ti2v": tiny_video.build_wan_ti2v,
        # LTX-2: video with sound (Gemma 3, connectors, an audio VAE and a vocoder).
        "ltx2": tiny_ltx2.build_ltx2,
        "ltx2-i2v": tiny_ltx2.build_ltx2_i2v,
        # HunyuanVideo-1.5: a Qwen2.5-VL text model, a ByT5 glyph encoder, a CFG guider (i2v: a SigLIP image encoder,
        # whose processor needs torchvision).
        "hunyuan-video-15": tiny_hunyuan15.build_hunyuan_video15,
        "hunyuan-video-15-i2v": tiny_hunyuan15.build_hunyuan_video15_i2v,
    }
    if family not in builders:
        raise ValueError(f"unknown model family {family!r}; valid families: {', '.join(FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[family]()


def build_tiny(family: str, out: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight diffusers checkpoint of `family` ("sd3" or "flux") to `out`; return its path."""
    pipe = build_tiny_pipeline(family, seed=seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    return out
