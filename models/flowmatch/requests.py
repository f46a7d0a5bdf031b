"""Request resolution and validation: what a request asks for, checked against the model (sizes, steps, guidance,
strengths, masks, edit and reference images, skip-layer guidance, the step cache's threshold, LoRA) and filled in
with the model's defaults, so that every rank runs the same thing from it; and the batch key, what must match for
requests to share a forward.

A family's adapter holds one (`FlowMatchAdapter.requests`), made with what it reads of the loaded model: the
capabilities, the checkpoint's declarations, the step cache (the threshold of requests that send none), the video
clips' frame rules and the LoRA registry's check. A family whose requests differ subclasses it in its own file (its
rules on CFG, on its input images' sizes, its defaults).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from diffusiond.models.base import Capabilities
from diffusiond.models.declared import Declared, check_declared
from diffusiond.models.inputs import image_size
from diffusiond.models.params import (
    MAX_GUIDANCE,
    MAX_SEED,
    MAX_STEPS,
    ParamError,
    SamplingParams,
    check_prompts,
)


class RequestRules:
    """`caps`: the loaded checkpoint's capabilities (the adapter hands new ones down when they change); `declared`:
    its declarations (models/declared.py); `cache`: the step cache (models/stepcache/cache.py); `clips`: the video
    clips' rules (models/flowmatch/clips.py), None for an image family; `loras`: a request's LoRA choices checked
    against the registry; `blocks`: the transformer's blocks (skip-layer guidance's range)."""

    # `true_cfg_scale` when a request sends none (families with true CFG beside a guidance embedding).
    default_true_cfg: ClassVar[float] = 1.0
    # Arguments of the pipeline's own call a request may set by name (`SamplingParams.arguments`) where a family has
    # switches of its own and no field of ours for them: name -> (type, its default as the call's, bounds for numbers).
    call_arguments: ClassVar[dict[str, tuple[type, Any, tuple[float, float] | None]]] = {}
    # Img2img's strength when a request with an image sends none (the Img2Img pipelines' default), and with a mask
    # (the Inpaint pipelines').
    default_strength: ClassVar[float] = 0.6
    default_inpaint_strength: ClassVar[float] = 0.6

    def __init__(
        self,
        caps: Capabilities,
        declared: Declared,
        *,
        cache: Any,
        clips: Any = None,
        loras: Callable[[SamplingParams], tuple | None] | None = None,
        blocks: int | None = None,
    ) -> None:
        if self.call_arguments:
            caps = dataclasses.replace(caps, call_arguments=tuple(self.call_arguments))
        self.caps, self.declared, self.cache, self.clips = caps, declared, cache, clips
        self.loras = loras
        self.blocks = blocks

    @property
    def family(self) -> str:
        return self.caps.family

    @property
    def image_inputs(self) -> tuple[str, ...]:
        return self.caps.image_inputs

    def uses_cfg(self, params: SamplingParams) -> bool:
        """Whether the request runs a negative branch (the family's pipeline's rule)."""
        raise NotImplementedError

    def context_size(self, params: SamplingParams) -> Hashable:
        """Instruction-edit families: the size(s) the request's image(s) are conditioned at; None without one."""
        return None

    def batch_key(self, params: SamplingParams) -> Hashable:
        # An edit's image tokens are part of every forward's sequence: edits batch with edits of the same context.
        return (params.width, params.height, self.uses_cfg(params), self.context_size(params))

    def resolve(self, params: SamplingParams) -> SamplingParams:
        caps = self.caps
        check_prompts(params)
        check_declared(self.declared, params)
        if params.images:
            raise ParamError(
                "images", f"the {self.family} family is served by a dedicated adapter; images is for the generic path"
            )
        arguments = self._call_arguments(params)
        strength = self._strength(params)
        width, height = self._size(params)
        for name, side in (("width", width), ("height", height)):
            if side is None:  # a sound family's: no size (`_size` refused one sent)
                continue
            if side < caps.size_multiple or side > caps.max_side or side % caps.size_multiple:
                raise ParamError(
                    name,
                    f"{name} must be a multiple of {caps.size_multiple} between {caps.size_multiple} and "
                    f"{caps.max_side} for this model, got {side}",
                )
        steps = params.num_inference_steps if params.num_inference_steps is not None else caps.default_steps
        if not 1 <= steps <= MAX_STEPS:
            raise ParamError(
                "num_inference_steps", f"num_inference_steps must be between 1 and {MAX_STEPS}, got {steps}"
            )
        guidance = params.guidance_scale if params.guidance_scale is not None else caps.default_guidance
        if not math.isfinite(guidance) or guidance < 0 or guidance > MAX_GUIDANCE:
            raise ParamError("guidance_scale", f"guidance_scale must be between 0 and {MAX_GUIDANCE:g}, got {guidance}")
        if guidance != caps.default_guidance and not {"cfg", "distilled", "skip-layer"} & set(caps.guidance_styles):
            # A knob the checkpoint ignores (diffusers only warns): a client would get the image of another setting.
            raise ParamError(
                "guidance_scale",
                f"this {caps.family} checkpoint has no guidance embedding, so guidance_scale changes nothing; its "
                "guidance is true_cfg_scale (with a negative_prompt)",
            )
        if params.negative_prompt is not None and not caps.supports_negative_prompt:
            raise ParamError(
                "negative_prompt",
                f"this {caps.family} checkpoint is guidance-distilled (no negative branch), so a negative_prompt "
                "changes nothing",
            )
        true_cfg = params.true_cfg_scale if params.true_cfg_scale is not None else self.default_true_cfg
        if not math.isfinite(true_cfg) or true_cfg < 0 or true_cfg > MAX_GUIDANCE:
            raise ParamError("true_cfg_scale", f"true_cfg_scale must be between 0 and {MAX_GUIDANCE:g}, got {true_cfg}")
        if true_cfg != self.default_true_cfg and "true-cfg" not in caps.guidance_styles:
            raise ParamError(
                "true_cfg_scale",
                f"{caps.family} has no true CFG, so true_cfg_scale changes nothing; its guidance is guidance_scale",
            )
        seed = params.seed
        if seed is None:
            # Random seeds stay below 2**53, so JavaScript clients (JSON numbers are doubles) can reuse them exactly.
            seed = int.from_bytes(os.urandom(8), "little") & (2**53 - 1)
        elif not 0 <= seed <= MAX_SEED:
            raise ParamError("seed", f"seed must be between 0 and {MAX_SEED}, got {seed}")
        if params.preview_every < 0:
            raise ParamError("preview_every", f"preview_every must be >= 0, got {params.preview_every}")
        if params.image is not None and params.skip_guidance_layers is not None:
            # As diffusers: its SD3 Img2Img pipeline has no skip-layer guidance.
            raise ParamError("skip_guidance_layers", "skip-layer guidance is for requests without an input image")
        resolved = SamplingParams(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            seed=seed,
            width=width,
            height=height,
            num_inference_steps=steps,
            guidance_scale=float(guidance),
            true_cfg_scale=float(true_cfg),
            guidance_scale_2=self._guidance_2(params, float(guidance)),
            preview_every=params.preview_every,
            stream_latents=params.stream_latents,
            preview=params.preview,
            **self.cache.request_fields(params, steps),
            **self._skip_layer_guidance(params),
            **self._audio_video_guidance(params),
            image=params.image,
            strength=strength,
            mask=self._mask(params),
            reference_images=self._references(params),
            edit_context=self._edit_context(params),
            start_step=self._start_step(steps, strength),
            **self._video(params),
            lora=self.loras(params) if self.loras is not None and params.lora else None,
            arguments=arguments,
        )
        if resolved.steps_to_run < 1:
            raise ParamError(
                "strength", f"strength {strength} leaves none of the {steps} steps to run; raise either of them"
            )
        return resolved

    def _call_arguments(self, params: SamplingParams) -> dict[str, Any] | None:
        """The call's own switches a request sets (`call_arguments`), each checked and the rest at their defaults;
        None where the family has none (and a request that sends any: 400)."""
        given = params.arguments or {}
        if not self.call_arguments:
            if given:
                raise ParamError(
                    "arguments",
                    f"the {self.family} family is served by a dedicated adapter; arguments is for the generic path",
                )
            return None
        out = {}
        for name, (kind, default, bounds) in self.call_arguments.items():
            value = given.get(name, default)
            if kind is bool and not isinstance(value, bool):
                raise ParamError("arguments", f"argument {name!r} must be true or false, got {value!r}")
            if kind is float:
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise ParamError("arguments", f"argument {name!r} must be a number, got {value!r}")
                if bounds is not None and not bounds[0] <= value <= bounds[1]:
                    raise ParamError(
                        "arguments", f"argument {name!r} must be between {bounds[0]:g} and {bounds[1]:g}, got {value}"
                    )
                value = float(value)
            out[name] = value
        unknown = sorted(set(given) - set(out))
        if unknown:
            raise ParamError(
                "arguments",
                f"the {self.family} family's call takes no argument {unknown[0]!r} from a request; it takes: "
                + ", ".join(self.call_arguments),
            )
        return out

    def _video(self, params: SamplingParams) -> dict[str, Any]:
        """The resolved video fields (`num_frames`, `fps`): the clips' rules; image families refuse them."""
        if self.clips is not None:
            return self.clips.fields(self.caps, params)
        for name in ("num_frames", "fps"):
            if getattr(params, name) is not None:
                raise ParamError(name, f"the {self.family} family makes images; {name} is for video models")
        return {}

    def _start_step(self, steps: int, strength: float | None) -> int:
        """Img2img's first schedule position, as the flow-matching Img2Img pipelines' `get_timesteps` computes
        `t_start` (in floats: 50 steps at strength 0.56 start at 21, so 29 run)."""
        if strength is None:
            return 0
        return int(max(steps - min(steps * strength, steps), 0))

    def _strength(self, params: SamplingParams) -> float | None:
        """The resolved strength: None without an input image, or with a clip's first frame (it is the clip's first
        frame at every step)."""
        if self.clips is not None:
            if params.image is None and self.clips.requires_image:
                raise ParamError("image", f"the {self.family} family animates an image: send the first frame (image)")
            if params.image is not None and "first-frame" in self.image_inputs:
                if params.strength is not None:
                    raise ParamError(
                        "strength", f"the {self.family} family keeps its first frame at every step; drop strength"
                    )
                return None
        if params.image is None:
            if params.strength is not None:
                raise ParamError("strength", "strength applies to requests with an input image")
            return None
        if "edit" in self.image_inputs:  # instruction editing: the image conditions every step, no strength
            if params.strength is not None:
                raise ParamError("strength", f"the {self.family} family edits by instruction; strength does not apply")
            self.context_size(params)  # a file that is not an image (or too small) is refused here, naming it
            return None
        if "img2img" not in self.image_inputs:
            raise ParamError("image", f"the {self.family} family takes no input image")
        default = self.default_inpaint_strength if params.mask is not None else self.default_strength
        strength = params.strength if params.strength is not None else default
        if not 0 <= strength <= 1:
            raise ParamError("strength", f"strength must be between 0 and 1, got {strength}")
        return float(strength)

    def _guidance_2(self, params: SamplingParams, guidance: float) -> float | None:
        """The low-noise expert's guidance (two-expert checkpoints); others refuse it."""
        if params.guidance_scale_2 is not None:
            raise ParamError(
                "guidance_scale_2",
                f"this {self.family} checkpoint has one denoiser; guidance_scale_2 is for two-expert checkpoints "
                "(Wan 2.2 A14B)",
            )
        return None

    def _edit_context(self, params: SamplingParams) -> str | None:
        """The resolved `edit_context`: families whose input image has no conditioning size of its own refuse it."""
        if params.edit_context is not None:
            raise ParamError(
                "edit_context",
                f"the {self.family} family conditions no input image at a size of its own; edit_context is for "
                "instruction edits (FLUX.1 Kontext)",
            )
        return None

    def _references(self, params: SamplingParams) -> tuple[bytes, ...] | None:
        if not params.reference_images:
            return None
        if "references" not in self.image_inputs:
            raise ParamError("reference_images", f"the {self.family} family edits one image; it takes no references")
        if params.image is None:
            raise ParamError("reference_images", "reference images follow the image to edit (image)")
        for data in params.reference_images:
            image_size(data, "reference_images")
        return tuple(params.reference_images)

    def _mask(self, params: SamplingParams) -> bytes | None:
        if params.mask is None:
            return None
        if "mask" not in self.image_inputs:
            raise ParamError("mask", f"the {self.family} family edits whole images; it takes no mask")
        if params.image is None:
            raise ParamError("mask", "a mask needs the image it masks (image)")
        image_size(params.mask, "mask")
        return params.mask

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """The requested size; a side not given is the model's default, or with an input image, the image's aspect
        ratio at the model's default area (so that an edit's cost does not depend on the file's resolution)."""
        caps = self.caps
        if params.image is None or params.width is not None or params.height is not None:
            width = params.width if params.width is not None else caps.default_width
            height = params.height if params.height is not None else caps.default_height
            return width, height
        image_width, image_height = image_size(params.image)
        area, ratio, m = caps.default_width * caps.default_height, image_width / image_height, caps.size_multiple
        if caps.sizes:  # a checkpoint that draws some sizes only: the one closest in aspect
            return min(caps.sizes, key=lambda size: abs(math.log(size[0] / size[1] / ratio)))
        width = max(m, min(caps.max_side, round(math.sqrt(area * ratio) / m) * m))
        height = max(m, min(caps.max_side, round(math.sqrt(area / ratio) / m) * m))
        return width, height

    # The pipeline's defaults (StableDiffusion3Pipeline.__call__).
    SKIP_LAYER_DEFAULTS: ClassVar[dict[str, float]] = {
        "skip_layer_guidance_scale": 2.8,
        "skip_layer_guidance_start": 0.01,
        "skip_layer_guidance_stop": 0.2,
    }

    def _skip_layer_guidance(self, params: SamplingParams) -> dict[str, Any]:
        """The resolved skip-layer guidance fields: all set when the request skips layers, else none."""
        layers = params.skip_guidance_layers
        if layers is None:
            for name in self.SKIP_LAYER_DEFAULTS:  # settings of a guidance not asked for: they would change nothing
                if getattr(params, name) is not None:
                    raise ParamError(name, f"{name} applies with skip_guidance_layers (the blocks to skip)")
            return {}
        if "skip-layer" not in self.caps.guidance_styles or self.blocks is None:
            raise ParamError("skip_guidance_layers", f"the {self.family} family has no skip-layer guidance")
        blocks = self.blocks
        if max(layers) >= blocks:
            raise ParamError(
                "skip_guidance_layers", f"this model's transformer has blocks 0 to {blocks - 1}, got {max(layers)}"
            )
        resolved: dict[str, Any] = {"skip_guidance_layers": tuple(sorted(set(layers)))}
        for name, default in self.SKIP_LAYER_DEFAULTS.items():
            value = getattr(params, name)
            resolved[name] = float(value if value is not None else default)
        return resolved

    # The audio-video guidance fields (LTX-2's, `RequestFields`).
    AUDIO_VIDEO_FIELDS: ClassVar[tuple[str, ...]] = (
        "audio_guidance_scale",
        "stg_scale",
        "audio_stg_scale",
        "modality_scale",
        "audio_modality_scale",
        "guidance_rescale",
        "audio_guidance_rescale",
        "stg_blocks",
    )

    def _audio_video_guidance(self, params: SamplingParams) -> dict[str, Any]:
        """The resolved audio-video guidance fields; families without "audio-video" guidance refuse them."""
        for name in self.AUDIO_VIDEO_FIELDS:
            if getattr(params, name) is not None:
                raise ParamError(
                    name, f"the {self.family} family makes no sound; {name} is for audio-video models (LTX-2)"
                )
        return {}


def output_sized_context(params: SamplingParams) -> tuple[int | None, int | None] | None:
    """`RequestRules.context_size` of a family whose one input image is read at the output's size (LongCat-Image-Edit,
    Qwen-Image-Layered): that size; a file that is not an image is refused here, naming `image`."""
    if params.image is None:
        return None
    image_size(params.image)
    return params.width, params.height
