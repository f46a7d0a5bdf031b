"""What a pipeline's call takes, read from its signature (a classic pipeline's `__call__`, a Modular pipeline's blocks'
inputs): which request fields reach it and under what names, what a request may add (`arguments`, `images`), how
the call hands its steps out (a step callback, or a Modular denoise loop), and what it makes (images, frames,
sound). Nothing here imports torch: resolution runs on the event loop's thread."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Request fields the call takes by another name.
RENAMES = {"mask": "mask_image", "fps": "frame_rate"}
# Request fields that are the server's, not the call's.
OURS = frozenset({"seed", "preview_every", "stream_latents", "preview", "quality"})
# Call parameters a request never sets: the server passes them (or their tensor forms cannot come over HTTP).
RESERVED = frozenset(
    {
        "prompt",
        "negative_prompt",
        "generator",
        "output_type",
        "return_dict",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "latents",
        "prompt_embeds",
        "negative_prompt_embeds",
        "pooled_prompt_embeds",
        "negative_pooled_prompt_embeds",
        "num_images_per_prompt",
        "num_videos_per_prompt",
        "num_waveforms_per_prompt",
        "ip_adapter_image_embeds",
        "cross_attention_kwargs",
        "joint_attention_kwargs",
        "attention_kwargs",
        "timesteps",
        "sigmas",
        "kwargs",
    }
)
# Per-prompt counts: the server makes one image per prompt (a request per image).
PER_PROMPT = ("num_images_per_prompt", "num_videos_per_prompt", "num_waveforms_per_prompt")


@dataclass(frozen=True)
class CallSpec:
    """`defaults`: every parameter the call takes and its default (`inspect.Parameter.empty` for none);
    `steps`: how it hands its steps out ("callback_on_step_end", "callback" or "loop"); `modality`: what it makes
    ("image", "video" or "audio")."""

    pipeline_class: str
    defaults: Mapping[str, Any]
    steps: str
    modality: str
    modular: bool = False
    # The output's fields, in the order they are looked for.
    outputs: tuple[str, ...] = ("images", "frames", "videos", "audios", "audio")
    image_inputs: tuple[str, ...] = field(default=())
    # A Modular pipeline's inputs its own blocks compute (latents of a reference image, its crop): never a request's.
    computed: frozenset[str] = frozenset()
    # Settings of its guider a request may change (a Modular pipeline's guidance lives there, not in its inputs).
    guider: tuple[str, ...] = ()
    # Its default size where the call's inputs say none for every branch (a Modular text-to-image branch's).
    size: tuple[int, int] | None = None

    def takes(self, name: str) -> bool:
        return name in self.defaults

    def default(self, name: str) -> Any:
        value = self.defaults.get(name, inspect.Parameter.empty)
        return None if value is inspect.Parameter.empty else value

    def argument_of(self, field_name: str) -> str | None:
        """The call's parameter a request field goes to; None if it takes none."""
        for name in (RENAMES.get(field_name), field_name):
            if name is not None and self.takes(name):
                return name
        return None

    def may_set(self, name: str) -> bool:
        """Whether a request may set `name` in `arguments` (a JSON value) or `images` (a file)."""
        return name in self.defaults and name not in RESERVED and name not in self.computed and name[:1] != "_"

    def settable(self) -> list[str]:
        """What a request may add in `arguments` and `images`, by name."""
        return sorted(n for n in self.defaults if self.may_set(n))


def classic_spec(pipeline_cls: type) -> CallSpec | None:
    """A classic pipeline class's spec; None if its `__call__` hands out no step callback."""
    parameters = inspect.signature(pipeline_cls.__call__).parameters
    defaults = {name: p.default for name, p in parameters.items() if name != "self" and p.kind != p.VAR_KEYWORD}
    if "callback_on_step_end" in defaults:
        steps = "callback_on_step_end"
    elif "callback" in defaults and "callback_steps" in defaults:
        steps = "callback"
    else:
        return None
    annotation = str(parameters.get("return", "")) + str(inspect.signature(pipeline_cls.__call__).return_annotation)
    if "num_frames" in defaults:
        modality = "video"
    elif "Audio" in annotation or "audio_end_in_s" in defaults or "audio_length_in_s" in defaults:
        modality = "audio"
    else:
        modality = "image"
    return CallSpec(pipeline_cls.__name__, defaults, steps, modality, image_inputs=image_inputs(defaults, modality))


def modular_spec(class_name: str, inputs: Mapping[str, Any], modality: str = "image", **more: Any) -> CallSpec:
    """A Modular pipeline's spec from its blocks' inputs (name -> default); `more`: CallSpec's `computed`, `guider`,
    `size`."""
    images = image_inputs(inputs, modality)
    return CallSpec(class_name, dict(inputs), "loop", modality, modular=True, image_inputs=images, **more)


def image_inputs(defaults: Mapping[str, Any], modality: str) -> tuple[str, ...]:
    """The call's `image` and `mask_image` in the words the routes read (models/families/specs.py): a video's first
    frame, an image to start from (with `strength`), an image to edit, a mask. Other images (`control_image`, ...)
    come in a request's `images`."""
    found = []
    if "image" in defaults:
        found.append("first-frame" if modality == "video" else "img2img" if "strength" in defaults else "edit")
    if "mask_image" in defaults:
        found.append("mask")
    return tuple(found)
