"""Loading a checkpoint onto the generic path: a classic pipeline folder (`model_index.json`) through its pipeline
class's own `from_pretrained`, or a Modular one (`modular_model_index.json`) through `ModularPipeline`, its
components loaded; and where its calls give control back (models/generic/calls.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from diffusiond.models.generic.calls import running
from diffusiond.models.generic.signature import RENAMES, CallSpec, classic_spec, modular_spec
from diffusiond.models.params import CLIENT_FIELDS

MODULAR_INDEX = "modular_model_index.json"


class NoStepCallback(ValueError):
    """The pipeline's call hands out no step: it cannot be served a step at a time."""


def is_modular(path: str) -> bool:
    return (
        os.path.isdir(path)
        and (Path(path) / MODULAR_INDEX).is_file()
        and not (Path(path) / "model_index.json").is_file()
    )


def spec_of(pipeline_class: str) -> CallSpec:
    """The call spec of a classic pipeline class diffusers has (ValueError naming why it cannot be served)."""
    import diffusers

    cls = getattr(diffusers, pipeline_class, None)
    if cls is None or not isinstance(cls, type):
        raise ValueError(f"diffusers {diffusers.__version__} has no pipeline class {pipeline_class!r}")
    spec = classic_spec(cls)
    if spec is None:
        raise NoStepCallback(
            f"{pipeline_class}'s __call__ offers no step callback (callback_on_step_end, or callback and "
            "callback_steps): it cannot run a step at a time"
        )
    return spec


def load_generic(cls: type, path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """The adapter `cls` (GenericAdapter) for the checkpoint in `path`."""
    if is_modular(path):
        return _load_modular(cls, path, device, dtype)
    from diffusiond.models.loading.pipelines import load_pipeline
    from diffusiond.models.loading.registry import read_model_index

    pipeline_class = read_model_index(path).get("_class_name", "<missing _class_name>")
    spec = spec_of(pipeline_class)
    pipe, path, _ = load_pipeline(pipeline_class, path, device=device, dtype=dtype)
    return cls(pipe, source=path, call=spec)


def _load_modular(cls: type, path: str, device: str, dtype: torch.dtype) -> Any:
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(path)
    pipe.load_components(dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    loops = _loops(pipe._blocks)
    if not loops:
        raise NoStepCallback(f"{type(pipe).__name__} has no denoise loop (LoopSequentialPipelineBlocks)")
    for loop in loops:
        _hook_loop(loop)
        loop.set_progress_bar_config(disable=True)  # each loop has its own bar: the pipeline's setting is not theirs
    blocks = pipe._blocks
    inputs = {p.name: p.default for p in blocks.inputs if p.name is not None}
    class_name = json.loads((Path(path) / "modular_model_index.json").read_text()).get(
        "_class_name", type(pipe).__name__
    )
    modality = "video" if "num_frames" in inputs else "image"
    # Guidance in the guider's settings (FLUX.3's ClassifierFreeGuidance): a request's guidance_scale goes there.
    guider = getattr(pipe, "guider", None)
    settings = ()
    if "guidance_scale" not in inputs and isinstance(getattr(guider, "guidance_scale", None), int | float):
        inputs["guidance_scale"], settings = float(guider.guidance_scale), ("guidance_scale",)
    defaults = _branch_defaults(blocks)
    width, height = defaults.get("width"), defaults.get("height")
    size = (width, height) if isinstance(width, int) and isinstance(height, int) else None
    spec = modular_spec(class_name, inputs, modality, computed=_computed(blocks), guider=settings, size=size)
    return cls(pipe, source=path, call=spec)


def _branch_defaults(block: Any) -> dict[str, Any]:
    """Each input's first default among the blocks and their branches: the auto blocks' merged inputs drop a default
    their branches disagree on (FLUX.3's size: 1024 from text, the reference's own from an image)."""
    found = {p.name: p.default for p in getattr(block, "inputs", ()) if p.name is not None and p.default is not None}
    for sub in (getattr(block, "sub_blocks", None) or {}).values():
        for name, value in _branch_defaults(sub).items():
            found.setdefault(name, value)
    return found


def _computed(block: Any) -> frozenset[str]:
    """What the blocks compute (their intermediate outputs), but what a request's own fields set (its prompt, which a
    prompt upsampler rewrites; its size, which an image-conditioned branch reads from the image)."""
    names = {o.name for o in getattr(block, "intermediate_outputs", ()) if getattr(o, "name", None)}
    for sub in (getattr(block, "sub_blocks", None) or {}).values():
        names |= _computed(sub)
    return frozenset(names - CLIENT_FIELDS - set(RENAMES.values()))


def _loops(block: Any) -> list[Any]:
    """Every denoise loop among a Modular pipeline's blocks (each branch of its conditional blocks)."""
    from diffusers.modular_pipelines.modular_pipeline import LoopSequentialPipelineBlocks

    found = [block] if isinstance(block, LoopSequentialPipelineBlocks) else []
    for sub in (getattr(block, "sub_blocks", None) or {}).values():
        found += _loops(sub)
    return found


def _hook_loop(loop: Any) -> None:
    """The loop's steps give control back: before its first (the call is prepared) and after each."""
    original = loop.loop_step

    def loop_step(components: Any, block_state: Any, **kwargs: Any) -> Any:
        call = running()
        total = len(getattr(block_state, "timesteps", ())) or None
        if call is not None:
            call.ready(total)
        components, block_state = original(components, block_state, **kwargs)
        if call is not None:
            call.stepped(getattr(block_state, "latents", None), total)
        return components, block_state

    loop.loop_step = loop_step
