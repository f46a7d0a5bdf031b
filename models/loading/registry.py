"""diffusers `model_index.json` `_class_name` -> the family's declarations (models/families/specs.py) and its adapter
class. The only place that maps names to code; the adapter's module (torch, diffusers) is imported when it is asked
for, so what a family supports is known before either is. A pipeline class no dedicated family serves, and a
Modular pipeline's folder (`modular_model_index.json`), go to the generic path (models/generic/)."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffusiond.models.families.specs import FAMILIES, GENERIC, Family, UnsupportedModelError

MODULAR_INDEX = "modular_model_index.json"

if TYPE_CHECKING:
    from diffusiond.models.base import ModelAdapter


def read_model_index(model: str) -> dict:
    """A checkpoint's model_index.json (a Modular pipeline's modular_model_index.json): a local folder's, or a hub
    id's (downloaded)."""
    if os.path.isdir(model):
        path = Path(model) / "model_index.json"
        if not path.is_file():
            path = Path(model) / MODULAR_INDEX
        if not path.is_file():
            raise FileNotFoundError(f"{model} has no model_index.json: not a diffusers checkpoint folder")
    elif model.startswith((".", "/", "~")) or os.path.exists(model):
        raise FileNotFoundError(f"{model} is not a checkpoint folder")
    else:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "model_index.json"))
    return json.loads(path.read_text())


def attention_heads(config: Mapping[str, Any]) -> int | None:
    """The attention heads a transformer's config declares (Z-Image calls them `n_heads`; a UNet has a count per
    block): what Ulysses and tensor-parallel degrees must divide. None if it declares no one count."""
    heads = config.get("num_attention_heads") or config.get("n_heads")
    return heads if isinstance(heads, int) else None


def is_modular(model: str) -> bool:
    """A Modular pipeline's folder: a modular_model_index.json and no model_index.json."""
    folder = Path(model)
    return os.path.isdir(model) and (folder / MODULAR_INDEX).is_file() and not (folder / "model_index.json").is_file()


def family_of_checkpoint(model: str, adapter: str = "auto") -> Family:
    """The family that serves `model`: its pipeline class's dedicated family, else the generic path (`adapter`
    "generic": the generic path whatever the class). Whether a class unknown here can run a step at a time is
    checked when it loads (models/generic/loading.py), with torch."""
    if adapter == "generic" or is_modular(model):
        return GENERIC
    pipeline_class = read_model_index(model).get("_class_name")
    if not isinstance(pipeline_class, str):
        raise UnsupportedModelError(f"{model}'s model_index.json names no pipeline class (_class_name)")
    return FAMILIES.get(pipeline_class, GENERIC)


def adapter_class(family: Family) -> type[ModelAdapter]:
    module, name = family.adapter.split(":")
    return getattr(importlib.import_module(f"diffusiond.models.{module}"), name)


def adapter_for(pipeline_class: str) -> type[ModelAdapter]:
    return adapter_class(FAMILIES.get(pipeline_class, GENERIC))
