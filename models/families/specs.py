"""What each family declares it supports, readable without torch: start-up validation (models/loading/setup.py),
README's table and `/v1/models` read these, and each adapter class takes its own (`ModelAdapter.spec`), so they are said
once. The adapter's module is imported only when a model of the family loads (models/loading/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusiond.models.stepcache.settings import CACHES

# How a family guides: "cfg" (a negative branch whenever `guidance_scale` says so), "distilled" (`guidance_scale`
# feeds a guidance embedding, one row), "true-cfg" (a negative branch with `true_cfg_scale` and a negative prompt),
# "skip-layer" (skip-layer guidance on top of CFG, `skip_guidance_layers`), "audio-video" (LTX-2: besides the video's
# CFG, the audio's own CFG, spatio-temporal and modality-isolation guidance for each modality, and their rescale).
GUIDANCE_STYLES = ("cfg", "distilled", "true-cfg", "skip-layer", "audio-video")


@dataclass(frozen=True)
class Family:
    # diffusers' pipeline class, as `model_index.json` names it (`_class_name`).
    pipeline_class: str
    family: str
    # "module:Class" of its adapter, under diffusiond.models.
    adapter: str
    guidance_styles: tuple[str, ...]
    # Parallel strategies over several ranks: "cfg-parallel" (the two CFG rows, or halves of a batch without CFG),
    # "ulysses" (sequence parallel attention; its degree must divide the transformer's heads), "ring" (ring attention
    # over the sharded sequence, alone or with Ulysses; a mask only over the replicated text: its padding), "tp" (tensor
    # parallel linears, by the family's plan), "shard-weights" (FSDP2: weights gathered block by block),
    # "vae-parallel" (one image decoded in strips by several ranks: 2D VAEs, and the causal video VAEs of Wan and
    # Qwen-Image, frame by frame).
    parallel: tuple[str, ...] = ("cfg-parallel",)
    # Step caches it implements (models/stepcache/methods.py), besides "none", and whether they run with Ulysses.
    cache_methods: tuple[str, ...] = ()
    cache_with_ulysses: bool = True
    cache_with_cfg_parallel: bool = True
    # Images a request may bring: "img2img" (starts from it, `strength`), "mask" (inpainting, with img2img), "edit"
    # (instruction editing), "references" (edits with more images: `reference_images`), "first-frame" (a video
    # that starts from the image).
    image_inputs: tuple[str, ...] = ()
    # What it makes: "image" or "video" (clips of frames; `Capabilities` then carries the frame rules).
    modality: str = "image"
    # Its answer to a request is several images, one per layer (Qwen-Image-Layered).
    layers: bool = False
    # LoRA per request (`SamplingParams.lora`, models/lora/registry.py): adapters of the denoiser, mixed in one batch.
    lora: bool = False
    # Packages its pipeline needs beyond diffusiond's own dependencies.
    needs: tuple[str, ...] = ()
    # Its attention takes masks (texts of a batch padded to the longest): kernels that refuse masks run in their
    # varlen form (kernels/attention.py MASKED).
    attention_masks: bool = False


ALL_PARALLEL = ("cfg-parallel", "ulysses", "ring", "tp", "shard-weights", "vae-parallel")

SD3 = Family(
    "StableDiffusion3Pipeline",
    "sd3",
    "families.sd3:SD3Adapter",
    guidance_styles=("cfg", "skip-layer"),
    parallel=ALL_PARALLEL,
    cache_methods=("fbcache", "dbcache", "teacache", "x0cache", "magcache"),
    image_inputs=("img2img", "mask"),
    lora=True,
)
SDXL = Family(
    "StableDiffusionXLPipeline",
    "sdxl",
    "families.sdxl:SDXLAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel", "shard-weights", "vae-parallel"),
    # A UNet: x0cache only (it skips the whole denoiser; the block caches read a transformer's blocks).
    cache_methods=("x0cache",),
    image_inputs=("img2img", "mask"),
    lora=True,
)
FLUX = Family(
    "FluxPipeline",
    "flux",
    "families.flux:FluxAdapter",
    guidance_styles=("distilled", "true-cfg"),
    parallel=ALL_PARALLEL,
    cache_methods=("fbcache", "dbcache", "teacache", "x0cache", "magcache"),
    image_inputs=("img2img", "mask"),
    lora=True,
)
FLUX_KONTEXT = Family(
    "FluxKontextPipeline",
    "flux-kontext",
    "families.kontext:FluxKontextAdapter",
    guidance_styles=FLUX.guidance_styles,
    parallel=FLUX.parallel,
    cache_methods=FLUX.cache_methods,
    image_inputs=("edit",),
    lora=True,
)
FLUX2_KLEIN = Family(
    "Flux2KleinPipeline",
    "flux2-klein",
    "families.flux2:Flux2KleinAdapter",
    guidance_styles=("cfg",),
    parallel=ALL_PARALLEL,
    cache_methods=FLUX.cache_methods,
    # Its cached forward does not shard tokens yet: --cache with --ulysses is refused at start.
    cache_with_ulysses=False,
    image_inputs=("edit", "references"),
    lora=True,
)
# FLUX.2 [dev]: klein's transformer with a guidance embedding and a Mistral-3 text encoder (Pixtral processor).
FLUX2 = Family(
    "Flux2Pipeline",
    "flux2",
    "families.flux2:Flux2Adapter",
    guidance_styles=("distilled",),
    parallel=ALL_PARALLEL,
    cache_methods=FLUX.cache_methods,
    cache_with_ulysses=False,
    image_inputs=("edit", "references"),
    lora=True,
    needs=("torchvision",),
)
Z_IMAGE = Family(
    "ZImagePipeline",
    "z-image",
    "families.zimage:ZImageAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel", "ulysses", "tp", "shard-weights", "vae-parallel"),
    cache_methods=FLUX.cache_methods,
    # Its Ulysses hooks shard around the layers its cached forward stands in for: refused together at start.
    cache_with_ulysses=False,
    image_inputs=("img2img", "mask"),
    lora=True,
    attention_masks=True,
)
QWEN_IMAGE = Family(
    "QwenImagePipeline",
    "qwen-image",
    "families.qwenimage:QwenImageAdapter",
    guidance_styles=("true-cfg", "distilled"),
    parallel=("cfg-parallel", "ulysses", "ring", "tp", "shard-weights", "vae-parallel"),
    cache_methods=("fbcache", "dbcache", "teacache", "x0cache", "magcache"),
    # Its cached forward does not shard tokens yet: --cache with --ulysses is refused at start.
    cache_with_ulysses=False,
    image_inputs=("img2img", "mask"),
    lora=True,
    attention_masks=True,
)
# Qwen-Image-Edit-2509/2511: instruction edits of one to three images (the first is edited, the others are its
# references), each read by the Qwen2.5-VL text encoder (at 384x384's area) and joining every step's sequence as
# latent tokens (at 1024x1024's area). Its Qwen2-VL processor needs torchvision.
QWEN_IMAGE_EDIT_PLUS = Family(
    "QwenImageEditPlusPipeline",
    "qwen-image-edit-plus",
    "families.qwenimage_edit:QwenImageEditPlusAdapter",
    guidance_styles=("true-cfg", "distilled"),
    parallel=("cfg-parallel", "ulysses", "ring", "tp"),
    cache_methods=QWEN_IMAGE.cache_methods,
    cache_with_ulysses=False,
    image_inputs=("edit", "references"),
    lora=True,
    attention_masks=True,
    needs=("torchvision",),
)
QWEN_IMAGE_EDIT = Family(
    "QwenImageEditPipeline",
    "qwen-image-edit",
    "families.qwenimage_edit:QwenImageEditAdapter",
    guidance_styles=QWEN_IMAGE_EDIT_PLUS.guidance_styles,
    parallel=QWEN_IMAGE_EDIT_PLUS.parallel,
    cache_methods=QWEN_IMAGE.cache_methods,
    cache_with_ulysses=False,
    image_inputs=("edit",),
    lora=QWEN_IMAGE_EDIT_PLUS.lora,
    attention_masks=True,
    needs=QWEN_IMAGE_EDIT_PLUS.needs,
)
# Qwen-Image-Layered: an image decomposed into RGBA layers (`arguments`: `layers`, `resolution`, `cfg_normalize`),
# the image's latents joining every step's sequence as an edit's; its Qwen2-VL processor needs torchvision.
QWEN_IMAGE_LAYERED = Family(
    "QwenImageLayeredPipeline",
    "qwen-image-layered",
    "families.qwenimage_layered:QwenImageLayeredAdapter",
    guidance_styles=("true-cfg",),
    parallel=("cfg-parallel", "ulysses", "ring", "tp"),
    cache_methods=QWEN_IMAGE.cache_methods,
    cache_with_ulysses=False,
    image_inputs=("edit",),
    layers=True,
    lora=True,
    attention_masks=True,
    needs=("torchvision",),
)
# Qwen-Image 2.1: a Qwen3-VL text encoder and a single-stream block-causal transformer whose 16x VAE decodes RGBA.
# Text to image, and conditioned on one to three images; CFG-parallel and Ulysses (models/families/qwenimage21.py says
# what is not served yet).
QWEN_IMAGE_21 = Family(
    "QwenImage21Pipeline",
    "qwen-image-21",
    "families.qwenimage21:QwenImage21Adapter",
    guidance_styles=("true-cfg",),
    parallel=("cfg-parallel", "ulysses"),
    # Decided per row (models/stepcache/span.py): no TeaCache (its blocks modulate by token, not by norm1).
    cache_methods=("fbcache", "dbcache", "x0cache", "magcache"),
    cache_with_ulysses=False,
    cache_with_cfg_parallel=False,
    image_inputs=("edit", "references"),
    lora=True,
    attention_masks=True,
    needs=("torchvision",),
)
WAN = Family(
    "WanPipeline",
    "wan",
    "families.wan.adapter:WanAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel", "ulysses", "ring", "shard-weights", "vae-parallel"),
    cache_methods=("fbcache", "dbcache", "teacache", "x0cache", "magcache"),
    modality="video",
    lora=True,
)
WAN_I2V = Family(
    "WanImageToVideoPipeline",
    "wan-i2v",
    "families.wan.i2v:WanI2VAdapter",
    guidance_styles=WAN.guidance_styles,
    parallel=WAN.parallel,
    cache_methods=WAN.cache_methods,
    modality="video",
    image_inputs=("first-frame",),
    lora=True,
    needs=("ftfy",),
)
# LTX-2: video and sound from one transformer (video and audio tokens, attending to each other), a Gemma 3 text
# encoder with connectors, a video VAE, an audio VAE and a vocoder (models/families/ltx2/adapter.py).
LTX2 = Family(
    "LTX2Pipeline",
    "ltx2",
    "families.ltx2.adapter:LTX2Adapter",
    guidance_styles=("cfg", "audio-video"),
    parallel=("cfg-parallel", "ulysses", "ring"),
    # Decided per row (models/families/ltx2/cache.py): a row's cache stays on one rank, its tokens whole.
    cache_methods=("fbcache", "dbcache", "x0cache"),
    cache_with_ulysses=False,
    cache_with_cfg_parallel=False,
    modality="video",
    image_inputs=("first-frame",),
    lora=True,
)
LTX2_I2V = Family(
    "LTX2ImageToVideoPipeline",
    "ltx2-i2v",
    "families.ltx2.adapter:LTX2I2VAdapter",
    guidance_styles=LTX2.guidance_styles,
    parallel=LTX2.parallel,
    cache_methods=LTX2.cache_methods,
    cache_with_ulysses=False,
    cache_with_cfg_parallel=False,
    modality="video",
    image_inputs=("first-frame",),
    lora=True,
)
# HunyuanVideo-1.5: a dual-stream transformer over video tokens reading Qwen2.5-VL, ByT5 glyph text and (image to
# video) SigLIP embeddings; a checkpoint is text- or image-to-video (models/families/hunyuan15.py).
HUNYUAN_VIDEO_15 = Family(
    "HunyuanVideo15Pipeline",
    "hunyuan-video-15",
    "families.hunyuan15:HunyuanVideo15Adapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel", "ulysses"),
    # Decided per row (models/stepcache/span.py): a row's cache stays on one rank, its tokens whole.
    cache_methods=("fbcache", "dbcache", "teacache", "x0cache", "magcache"),
    cache_with_ulysses=False,
    cache_with_cfg_parallel=False,
    modality="video",
    attention_masks=True,
)
HUNYUAN_VIDEO_15_I2V = Family(
    "HunyuanVideo15ImageToVideoPipeline",
    "hunyuan-video-15-i2v",
    "families.hunyuan15:HunyuanVideo15I2VAdapter",
    guidance_styles=("cfg",),
    parallel=HUNYUAN_VIDEO_15.parallel,
    cache_methods=HUNYUAN_VIDEO_15.cache_methods,
    cache_with_ulysses=False,
    cache_with_cfg_parallel=False,
    modality="video",
    image_inputs=("first-frame",),
    attention_masks=True,
    # Its SigLIP image processor (transformers' image processors need torchvision).
    needs=("torchvision",),
)

# The generic path (models/generic/): any other pipeline whose call hands out its steps, and Modular pipelines, run
# through their own call. One rank; no step cache, no LoRA (the dedicated families' advantages).
GENERIC = Family(
    "*",
    "generic",
    "generic.adapter:GenericAdapter",
    guidance_styles=(),
    parallel=(),
    image_inputs=(),
    needs=("greenlet",),
)

# Ovis-Image: FLUX.1's packed latents and rotary ids under its own MMDiT (no pooled text, no guidance embedding), a
# Qwen3 text encoder read through a chat template, CFG whenever `guidance_scale` > 1.
OVIS_IMAGE = Family(
    "OvisImagePipeline",
    "ovis-image",
    "families.ovis:OvisImageAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel",),
    cache_methods=("fbcache", "dbcache", "x0cache"),
)

# LongCat-Image: Ovis-Image's kind of MMDiT (FLUX.1's packed latents), a Qwen2.5-VL text encoder that first rewrites
# each prompt (generating text; `arguments: {"enable_prompt_rewrite": false}` skips it), CFG with renormalization.
LONGCAT_IMAGE = Family(
    "LongCatImagePipeline",
    "longcat-image",
    "families.longcat:LongCatImageAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel", "tp"),
    cache_methods=("fbcache", "dbcache", "x0cache"),
    needs=("torchvision",),
)
# LongCat-Image-Edit: LongCat-Image's components; the image to edit is read by the text encoder and its latent follows
# the noisy latents in every step (no rewrite, no renormalization).
LONGCAT_IMAGE_EDIT = Family(
    "LongCatImageEditPipeline",
    "longcat-image-edit",
    "families.longcat:LongCatImageEditAdapter",
    guidance_styles=("cfg",),
    parallel=LONGCAT_IMAGE.parallel,
    cache_methods=LONGCAT_IMAGE.cache_methods,
    image_inputs=("edit",),
    needs=("torchvision",),
)
# GLM-Image: an autoregressive prior samples each image's tokens, which condition a DiT beside the glyphs of the
# prompt's quoted text (ByT5); CFG whenever guidance > 1, its negative row without the prior's tokens.
GLM_IMAGE = Family(
    "GlmImagePipeline",
    "glm-image",
    "families.glm_image:GlmImageAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel", "tp"),
    # Its caches decide per row (a request's rows run in calls of their glyph lengths): not with CFG-parallel.
    cache_methods=("fbcache", "dbcache", "x0cache"),
    cache_with_cfg_parallel=False,
    needs=("torchvision",),
)
# Stable Audio Open: sound alone, a DiT over the latent frames of the longest clip with the clip's seconds as its
# global condition, the cosine DPM-Solver (an SDE: each request its own Brownian tree), CFG whenever guidance > 1.
STABLE_AUDIO = Family(
    "StableAudioPipeline",
    "stable-audio",
    "families.stable_audio:StableAudioAdapter",
    guidance_styles=("cfg",),
    parallel=("cfg-parallel",),
    cache_methods=("teacache", "fbcache", "dbcache"),
    modality="audio",
    needs=("torchsde",),
)

FAMILIES: dict[str, Family] = {
    f.pipeline_class: f
    for f in (
        SD3,
        SDXL,
        FLUX,
        FLUX_KONTEXT,
        FLUX2_KLEIN,
        FLUX2,
        Z_IMAGE,
        OVIS_IMAGE,
        LONGCAT_IMAGE,
        LONGCAT_IMAGE_EDIT,
        QWEN_IMAGE,
        QWEN_IMAGE_EDIT,
        QWEN_IMAGE_EDIT_PLUS,
        QWEN_IMAGE_LAYERED,
        QWEN_IMAGE_21,
        WAN,
        WAN_I2V,
        LTX2,
        LTX2_I2V,
        HUNYUAN_VIDEO_15,
        HUNYUAN_VIDEO_15_I2V,
        GLM_IMAGE,
        STABLE_AUDIO,
    )
}


# Hub checkpoints whose family and transformer heads are known without downloading them (their model_index.json
# `_class_name` and transformer config's `num_attention_heads`): `serve --model ID` checks its layout against them
# at start, not after minutes of download, and the shipped manifests are checked against them in CI.
KNOWN_CHECKPOINTS: dict[str, tuple[str, int]] = {
    "stabilityai/stable-diffusion-3-medium-diffusers": ("StableDiffusion3Pipeline", 24),
    "stabilityai/stable-diffusion-3.5-medium": ("StableDiffusion3Pipeline", 24),
    "stabilityai/stable-diffusion-3.5-large": ("StableDiffusion3Pipeline", 38),
    "black-forest-labs/FLUX.1-dev": ("FluxPipeline", 24),
    "black-forest-labs/FLUX.1-schnell": ("FluxPipeline", 24),
    "black-forest-labs/FLUX.1-Kontext-dev": ("FluxKontextPipeline", 24),
    "black-forest-labs/FLUX.2-dev": ("Flux2Pipeline", 48),
    "Qwen/Qwen-Image": ("QwenImagePipeline", 24),
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("WanPipeline", 12),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": ("WanPipeline", 40),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": ("WanImageToVideoPipeline", 40),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": ("WanPipeline", 40),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": ("WanImageToVideoPipeline", 40),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": ("WanPipeline", 24),
    "Qwen/Qwen-Image-Edit": ("QwenImageEditPipeline", 24),
    "Qwen/Qwen-Image-Edit-2509": ("QwenImageEditPlusPipeline", 24),
    "Qwen/Qwen-Image-Edit-2511": ("QwenImageEditPlusPipeline", 24),
    "Lightricks/LTX-2": ("LTX2Pipeline", 32),
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v": ("HunyuanVideo15Pipeline", 16),
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v": ("HunyuanVideo15ImageToVideoPipeline", 16),
}


class UnsupportedModelError(ValueError):
    pass


def family_of(pipeline_class: str) -> Family:
    try:
        return FAMILIES[pipeline_class]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedModelError(
            f"no adapter for pipeline class {pipeline_class!r}; supported: {supported}"
        ) from None


def families_table() -> str:
    """README's table of supported families, from the declarations (a test keeps README equal to it)."""

    def listed(values) -> str:
        return ", ".join(values) or "-"

    lines = [
        "| `_class_name` | family | output | guidance | parallel | step cache | LoRA | image inputs | needs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in FAMILIES.items():
        cells = [
            f"`{name}`",
            f.family,
            "image layers" if f.layers else f.modality,
            listed(f.guidance_styles),
            listed(f.parallel),
            "all" if set(f.cache_methods) == set(CACHES) else listed(f.cache_methods),
            "yes" if f.lora else "-",
            listed(f.image_inputs),
            listed(f.needs),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "| any other with a step callback (`StableDiffusionPipeline`, `AudioLDMPipeline`, ...), and Modular "
        "pipelines (`modular_model_index.json`) | generic | what the call returns: image, video, audio | the call's "
        "own | - | - | - | what the call takes (`image`, `mask_image`; others by name in `images`) | "
        f"{listed(GENERIC.needs)} |"
    )
    return "\n".join(lines) + "\n"
