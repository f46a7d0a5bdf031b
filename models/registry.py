"""diffusers `model_index.json` `_class_name` -> adapter class. The only place that maps names to code."""

from __future__ import annotations

from diffusiond.models.base import ModelAdapter
from diffusiond.models.flux import FluxAdapter
from diffusiond.models.qwenimage import QwenImageAdapter
from diffusiond.models.sd3 import SD3Adapter
from diffusiond.models.zimage import ZImageAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    cls.pipeline_class: cls for cls in (SD3Adapter, FluxAdapter, ZImageAdapter, QwenImageAdapter)
}


class UnsupportedModelError(ValueError):
    pass


def adapter_for(pipeline_class: str) -> type[ModelAdapter]:
    try:
        return ADAPTERS[pipeline_class]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedModelError(
            f"no adapter for pipeline class {pipeline_class!r}; supported: {supported}"
        ) from None
