"""What a model can be asked for one request: its sampling parameters, their bounds, and the LoRA adapters it
chooses. Plain data (msgspec), read by every layer: the HTTP bodies reuse these types, the wire carries
`SamplingParams`, the adapters resolve them (`ModelAdapter.resolve`).

These are the only bounds of a request's fields. They keep absurd values out (msgpack carries integers in
[-2**63, 2**64 - 1] only, and a number nobody can run is better refused at the edge than inside a step); the model's
capabilities and the operator's limits (`RequestLimits`) are narrower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

MAX_SEED = 2**63 - 1
MAX_SIDE = 1 << 16
# Schedulers train on 1,000 timesteps; more steps than that only repeat them.
MAX_STEPS = 1000
MAX_GUIDANCE = 100.0
MAX_PROMPT_CHARS = 10_000
# An input image (edits, img2img) as its client sent the file: PNG, JPEG, WebP... The operator's --max-image-bytes is
# narrower.
MAX_IMAGE_BYTES = 64 << 20
# Reference images a request may add after its `image` (families that declare "references" may take fewer).
MAX_REFERENCES = 4
# Video: frames per clip.
MAX_FRAMES = 1024

Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)]
Side = Annotated[int, msgspec.Meta(ge=1, le=MAX_SIDE)]
Steps = Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)]
# Every K steps; 0: never.
Every = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEPS)]
Guidance = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GUIDANCE)]
Prompt = Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
ImageFile = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_IMAGE_BYTES)]
References = Annotated[tuple[ImageFile, ...], msgspec.Meta(min_length=1, max_length=MAX_REFERENCES)]
Frames = Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAMES)]
Fps = Annotated[int, msgspec.Meta(ge=1, le=240)]
Layers = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=1000)], ...], msgspec.Meta(min_length=1, max_length=64)]
PreviewMode = Literal["fast", "vae"]
# Where an instruction edit (FLUX.1 Kontext) conditions its input image: "preferred", the Kontext training resolution
# nearest the image's aspect (about 1 Mpx, as `FluxKontextPipeline`); "output", that resolution scaled to the output's
# area (fewer tokens below 1 Mpx: cheaper, and not the pipeline's image).
EditContext = Literal["preferred", "output"]
Quality = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
CacheThreshold = Annotated[float, msgspec.Meta(ge=0, le=10)]
# SCM step masks (models/stepcache/methods.py `scm_steps`): a preset, or the steps that always compute (0 is the first).
ScmPreset = Literal["fast", "medium", "slow", "off"]
CacheSteps = (
    ScmPreset
    | Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, lt=MAX_STEPS)], ...], msgspec.Meta(max_length=MAX_STEPS)]
)

# A generic call's further arguments (models/generic/): a parameter's name and a JSON value.
ArgumentName = Annotated[str, msgspec.Meta(pattern=r"^[a-z_][a-z0-9_]{0,63}$")]
Number = Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)]
Argument = (
    bool
    | Annotated[int, msgspec.Meta(ge=-(2**53), le=2**53)]
    | Number
    | Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
    | Annotated[tuple[Number, ...], msgspec.Meta(max_length=64)]
)

# LoRA adapters a request applies (by the names the operator registered) and their scales.
LORA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MAX_LORAS = 8
MAX_LORA_SCALE = 10.0


class LoraChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One adapter of a request's `lora`: a name the server lists at `GET /v1/loras`, and how strongly it applies.
    HTTP bodies take it as `{"name": "style", "scale": 0.8}`."""

    name: Annotated[str, msgspec.Meta(pattern=LORA_NAME)]
    scale: Annotated[float, msgspec.Meta(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)] = 1.0
    # Two-expert checkpoints (Wan 2.2 A14B, whose LoRAs ship in pairs): 1 applies the adapter in `transformer`
    # (the high-noise steps; the default, as the pipeline's `load_lora_weights`), 2 in `transformer_2` (the
    # low-noise steps, `load_into_transformer_2`). An adapter for both is named twice, once per expert.
    expert: Annotated[int, msgspec.Meta(ge=1, le=2)] | None = None


# `[]` is the same as no `lora` (clients that build the list need not leave the field out).
Loras = Annotated[tuple[LoraChoice, ...], msgspec.Meta(max_length=MAX_LORAS)]


class ParamError(ValueError):
    """A request parameter is invalid for this model; `param` names the field (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestFields(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """What a client may ask of one request, and the bounds of each field: the native API's body is these fields
    (daemon/api.py `GenerationRequest`), every other request shape converts into them (`params_from`), and the
    resolved `SamplingParams` crosses the wire. The bounds are checked wherever a struct is decoded (HTTP bodies, the
    engine's round trip of every request through the wire before it is queued), never by the constructor.

    `guidance_scale` is the family's main guidance knob (classifier-free guidance for SD3, the distilled guidance
    embedding for FLUX); `true_cfg_scale` is FLUX's optional real CFG, used with a negative prompt.
    """

    prompt: Prompt
    negative_prompt: Prompt | None = None
    seed: Seed | None = None
    width: Side | None = None
    height: Side | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    true_cfg_scale: Guidance | None = None
    # Two-expert checkpoints (Wan 2.2 A14B): the guidance of the low-noise expert's steps (default: guidance_scale,
    # as the pipeline's). Whether CFG runs at all is guidance_scale's call, as in the pipeline.
    guidance_scale_2: Guidance | None = None
    # Audio-video guidance (families that declare "audio-video", LTX-2; defaults: the pipeline's). `guidance_scale` is
    # the video's CFG, these the rest: the audio's CFG, spatio-temporal guidance (STG: away from the prediction with
    # self-attention perturbed in `stg_blocks`), modality-isolation guidance (away from the prediction without the
    # audio <-> video cross-attention), and the rescale of each modality's guided prediction.
    audio_guidance_scale: Guidance | None = None
    stg_scale: Guidance | None = None
    audio_stg_scale: Guidance | None = None
    modality_scale: Guidance | None = None
    audio_modality_scale: Guidance | None = None
    guidance_rescale: Fraction | None = None
    audio_guidance_rescale: Fraction | None = None
    stg_blocks: Layers | None = None
    # Emit a preview every K steps (0: never). Previews never change the final image.
    preview_every: Every = 0
    # With each preview, also hand out the raw latent.
    stream_latents: bool = False
    # How previews are made: "fast", the latent -> RGB map (latent resolution, about free); "vae", the predicted
    # clean latent decoded by the model's VAE (exact colours, full resolution, one VAE decode per preview).
    preview: PreviewMode = "fast"
    # Step caching (models/stepcache/methods.py): this request reuses its remaining blocks' residual while its first
    # block's residual changes by less than this (relative L1). 0: every step computes (exact). Resolved from the
    # server's --cache-threshold when the client sends none.
    cache_threshold: CacheThreshold | None = None
    # How much speed a request trades for agreement with its exact image, where the server runs a step cache
    # (models/stepcache/settings.py `quality_level`): "lossless" (no reuse), "high", "balanced" (the server's
    # threshold), "fast"; OpenAI's "high", "medium", "low", "auto" (and "hd", "standard") as those; an unknown word is
    # mapped, not refused (one that says more than high, "xhigh", is lossless). A `cache_threshold` sent with it wins.
    # Resolved to the preset applied; without a step cache every preset is exact.
    quality: Quality | None = None
    # The steps that compute whatever the cache's signal (SCM): "fast", "medium", "slow" (Cache-DiT's masks, stretched
    # to the request's steps), "off", or the step indices; the others reuse while the signal allows. Resolved to the
    # indices, from the server's --cache-config "scm" when the client sends none.
    cache_steps: CacheSteps | None = None
    # Skip-layer guidance (families that declare "skip-layer", SD3.5's recommendation: layers 7, 8, 9): with CFG,
    # for steps i with start * steps < i < stop * steps, the image is also pushed away from the prediction of the
    # transformer run with these blocks skipped, by `skip_layer_guidance_scale`. Unset: off.
    skip_guidance_layers: Layers | None = None
    skip_layer_guidance_scale: Guidance | None = None
    skip_layer_guidance_start: Fraction | None = None
    skip_layer_guidance_stop: Fraction | None = None
    # Image to image: the request starts from this image (an encoded file, decoded on every rank when the request
    # is prepared), noised to `strength` of the schedule: about the last strength * num_inference_steps steps run
    # (`steps_to_run`), as in diffusers' Img2Img pipelines. At `strength` 1 only the image's aspect is kept.
    image: ImageFile | None = None
    strength: Fraction | None = None
    # Inpainting (families that declare "mask"): only where this file is white (or, in a file with alpha, transparent:
    # OpenAI's convention) is the image repainted; elsewhere each step pins it to the input noised to that step.
    mask: ImageFile | None = None
    # Multi-reference editing (families that declare "references"): more images after `image`, each conditioning
    # every step ("put the cat of the second image on the sofa of the first").
    reference_images: References | None = None
    # Instruction edits (FLUX.1 Kontext): the size the input image is conditioned at
    # (`EditContext`); resolved to "preferred" for an edit, None otherwise.
    edit_context: EditContext | None = None
    # Video families ("video" in the adapter's capabilities `modality`): frames of the clip (each family's rule, Wan's
    # 4k + 1) and the frame rate its file plays at (changes no pixel). Refused by image families.
    num_frames: Frames | None = None
    fps: Fps | None = None
    # LoRA adapters (families that declare `lora`), each at its scale, added to this request's rows of every forward
    # while other requests of the same batch use others or none (kernels/lora_rows.py). `[]` is none.
    lora: Loras | None = None
    # The generic path (models/generic/): further arguments of the pipeline's call by name (JSON values: numbers,
    # booleans, strings, lists of numbers), and further images it takes by name (`control_image`, ...). What a
    # pipeline takes is listed at /v1/models (`fields`); anything else is refused, naming it. A dedicated family with
    # call switches of its own takes those in `arguments` (LongCat-Image's prompt rewrite: /v1/models `arguments`).
    arguments: Annotated[dict[ArgumentName, Argument], msgspec.Meta(max_length=32)] | None = None
    images: Annotated[dict[ArgumentName, ImageFile], msgspec.Meta(max_length=MAX_REFERENCES)] | None = None


class SamplingParams(RequestFields, frozen=True, kw_only=True, array_like=True):
    """Everything that decides a request's image, fully resolved before it reaches the wire: every rank must compute
    the same thing from it, so `None` never means "pick something" past `ModelAdapter.resolve`."""

    # The schedule position the request starts at: 0, or with `strength` its family's Img2Img pipeline's `t_start`
    # (each family's arithmetic: 50 steps at strength 0.56 run 29 in the flow-matching ones, 28 in SDXL's). Set by
    # `ModelAdapter.resolve`, never by clients.
    start_step: Annotated[int, msgspec.Meta(ge=0, le=MAX_STEPS)] = 0

    @property
    def steps_to_run(self) -> int:
        """Denoising steps the request runs (its forwards, progress total and preview spacing)."""
        return (self.num_inference_steps or 0) - self.start_step


def check_prompts(params: SamplingParams) -> None:
    """A request's prompt is a non-empty string and its prompts within MAX_PROMPT_CHARS (ParamError naming which)."""
    if not isinstance(params.prompt, str) or not params.prompt.strip():
        raise ParamError("prompt", "prompt must be a non-empty string")
    for name in ("prompt", "negative_prompt"):
        text = getattr(params, name)
        if text is not None and len(text) > MAX_PROMPT_CHARS:
            raise ParamError(name, f"{name} is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS}")


# The fields a client may set (`start_step` is the adapter's to set).
CLIENT_FIELDS: frozenset[str] = frozenset(RequestFields.__struct_fields__)


def params_from(values: Mapping[str, Any], renames: Mapping[str, str] | None = None, **computed: Any) -> SamplingParams:
    """The one conversion of a request (an HTTP body's fields, the command line's flags) into parameters: every value
    whose name, or its name in `renames`, is a client field, then `computed` (what the caller worked out: a size from
    `size`, a file it read). Values were checked against these types where they were decoded; the model and the wire
    check the result (`Engine.check`). An empty `lora` is no LoRA."""
    renames = renames or {}
    fields = {renames.get(name, name): value for name, value in values.items()}
    chosen = {name: value for name, value in fields.items() if name in CLIENT_FIELDS}
    chosen.update(computed)
    if not chosen.get("lora"):
        chosen["lora"] = None
    return SamplingParams(**chosen)


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What the operator lets one request ask for (`--max-pixels`, `--max-steps`, `--max-frames`), resolved at
    start-up from the configuration and the model's capabilities. `n` (images per HTTP request) is the HTTP layer's
    own limit."""

    max_pixels: int
    max_steps: int
    # Frames per clip (video models; None: image models).
    max_frames: int | None = None

    def check(self, params: SamplingParams) -> tuple[str, str] | None:
        """(field, message) for the first limit that resolved `params` exceed; None when within limits."""
        pixels = (params.width or 0) * (params.height or 0)
        if pixels > self.max_pixels:
            return "width", (
                f"{params.width}x{params.height} is {pixels} pixels; this server allows at most {self.max_pixels} "
                f"per image (--max-pixels)"
            )
        if (params.num_inference_steps or 0) > self.max_steps:
            return "num_inference_steps", (
                f"num_inference_steps {params.num_inference_steps} is above this server's limit of {self.max_steps} "
                f"(--max-steps)"
            )
        if self.max_frames is not None and (params.num_frames or 0) > self.max_frames:
            return "num_frames", (
                f"num_frames {params.num_frames} is above this server's limit of {self.max_frames} (--max-frames)"
            )
        return None
