"""Tiny random-weight checkpoints of every family, built entirely offline (`diffusiond make-tiny`).

`build_tiny(family, out)` constructs every pipeline component with a tiny config under a fixed seed and writes a
diffusers checkpoint folder with the pipeline's own `save_pretrained`, so `model_index.json` and each component's
config are exactly what diffusers writes for a real checkpoint. The folder loads back with
`StableDiffusion3Pipeline.from_pretrained(out)` / `FluxPipeline.from_pretrained(out)` and generates (noise-like)
images at any height/width that is a multiple of 16 (SD3: up to 1024, as pos_embed_max_size=64 allows), in
well under a second at 256x256 on a CPU.

The builders live beside this dispatcher, one module per group of families (`images`: SD3, SDXL, FLUX.1; `qwen`,
`qwen21`, `qwen_layered`, `ovis`, `longcat`, `glm_image`, `wan`, `ltx2`, `hunyuan15`, `flux3`; `real`: real-size
layouts; `lora`: adapters), on the shared text side (`text`: tokenizers over a fixed word list, tiny text
encoders). Only this module imports them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES: tuple[str, ...] = (
    "sd3",
    "sd35",
    "sdxl",
    "sd15",
    "stable-audio",
    "flux-modular",
    "kandinsky6",
    "flux3-klein",
    "flux",
    "flux-kontext",
    "flux2-klein",
    "flux2",
    "z-image",
    "ovis-image",
    "longcat-image",
    "longcat-image-edit",
    "glm-image",
    "qwen-image",
    "qwen-image-edit",
    "qwen-image-edit-plus",
    "qwen-image-layered",
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
# Those no dedicated family serves: the generic path does (models/generic/), on one rank.
GENERIC_FAMILIES: tuple[str, ...] = ("sd15", "flux-modular", "kandinsky6", "flux3-klein")
# Those whose latents no fitted picture map reads (make-tiny writes none): the generic path's, and sound.
NO_PREVIEW_MAP: tuple[str, ...] = (*GENERIC_FAMILIES, "stable-audio")


def build_tiny_pipeline(family: str, seed: int = 0) -> Any:
    """The tiny pipeline for `family`, in memory (fp32, CPU). Same weights as `build_tiny` writes."""
    import torch

    from diffusiond.models.tiny import (
        audio,
        flux3,
        glm_image,
        hunyuan15,
        images,
        kandinsky6,
        longcat,
        ltx2,
        ovis,
        qwen,
        qwen21,
        qwen_layered,
        wan,
    )

    builders = {
        "sd3": images.build_sd3,
        # SD3.5 Medium's layout: RMS-normed q/k and a second (self-only) attention in the first layers.
        "sd35": lambda: images.build_sd3(qk_norm="rms_norm", dual_attention_layers=(0,)),
        "sdxl": images.build_sdxl,
        # Stable Diffusion 1.5: no dedicated family; served on the generic path (models/generic/).
        "sd15": images.build_sd15,
        # Stable Audio Open: sound alone (models/families/stable_audio.py; its scheduler needs torchsde).
        "stable-audio": audio.build_stable_audio,
        # FLUX.1 as a Modular pipeline (modular_model_index.json): the generic path steps its denoise loop.
        "flux-modular": images.build_flux_modular,
        # Kandinsky 6: video with sound (a Qwen2.5-VL processor, HunyuanVideo's VAE, MMAudio's VAE and vocoder).
        "kandinsky6": kandinsky6.build_kandinsky6,
        # FLUX.3 [klein] as its Modular pipeline: a Qwen3.5 prompt upsampler, a Qwen3-VL text encoder (their
        # processors need torchvision), FLUX.2's VAE, a CFG guider.
        "flux3-klein": flux3.build_flux3klein,
        "flux": images.build_flux,
        "flux-kontext": images.build_kontext,
        "z-image": qwen.build_zimage,
        # Ovis-Image: a Qwen3 text encoder through its chat template, a FLUX-style MMDiT, FLUX's VAE.
        "ovis-image": ovis.build_ovis_image,
        # LongCat-Image: a Qwen2.5-VL text encoder that also rewrites prompts (its processor needs torchvision).
        "longcat-image": longcat.build_longcat_image,
        # LongCat-Image-Edit: the same components; the text encoder's vision tower reads the image to edit.
        "longcat-image-edit": longcat.build_longcat_image_edit,
        # GLM-Image: an autoregressive prior (its processor needs torchvision), a ByT5 glyph encoder, a DiT.
        "glm-image": glm_image.build_glm_image,
        "qwen-image": qwen.build_qwenimage,
        # Qwen-Image-Edit and -2509's layouts (need torchvision, for their Qwen2-VL processor).
        "qwen-image-edit": lambda: qwen.build_qwenimage_edit_plus(plus=False),
        "qwen-image-edit-plus": qwen.build_qwenimage_edit_plus,
        # Qwen-Image-Layered: an image decomposed into RGBA layers (an RGBA VAE; a layered transformer).
        "qwen-image-layered": qwen_layered.build_qwenimage_layered,
        "flux2-klein": qwen.build_flux2klein,
        # Qwen-Image 2.1: a Qwen3-VL text encoder (its processor needs torchvision), an RGBA VAE.
        "qwen-image-21": qwen21.build_qwenimage21,
        # FLUX.2 [dev]: a Mistral-3 text encoder read through a Pixtral processor (needs torchvision).
        "flux2": qwen.build_flux2dev,
        "wan": wan.build_wan,
        "wan-i2v": wan.build_wan_i2v,
        # Wan 2.2 A14B: two experts (`transformer_2`, `boundary_ratio`); its I2V without image cross-attention.
        "wan22": lambda: wan.build_wan(two_experts=True),
        "wan22-i2v": lambda: wan.build_wan_i2v(image_context=False, two_experts=True),
        # Wan 2.2 TI2V-5B: text and image to video from one checkpoint (`expand_timesteps`, Wan 2.2's VAE).
        "wan22-ti2v": wan.build_wan_ti2v,
        # LTX-2: video with sound (Gemma 3, connectors, an audio VAE and a vocoder).
        "ltx2": ltx2.build_ltx2,
        "ltx2-i2v": ltx2.build_ltx2_i2v,
        # HunyuanVideo-1.5: a Qwen2.5-VL text model, a ByT5 glyph encoder, a CFG guider (i2v: a SigLIP image encoder,
        # whose processor needs torchvision).
        "hunyuan-video-15": hunyuan15.build_hunyuan_video15,
        "hunyuan-video-15-i2v": hunyuan15.build_hunyuan_video15_i2v,
    }
    if family not in builders:
        raise ValueError(f"unknown model family {family!r}; valid families: {', '.join(FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[family]()


def build_tiny(family: str, out: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight diffusers checkpoint of `family`  to `out`; return its path."""
    pipe = build_tiny_pipeline(family, seed=seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if type(pipe).__module__.startswith("diffusers.modular_pipelines"):
        # Its components saved beside the index, which then loads them from this folder.
        pipe.save_pretrained(str(out.resolve()), overwrite_modular_index=True)
    else:
        pipe.save_pretrained(out)
    return out
