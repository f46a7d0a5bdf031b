"""diffusers `model_index.json` `_class_name` -> adapter class. The only place that maps names to code."""

from __future__ import annotations

from diffusiond.models.base import ModelAdapter
from diffusiond.models.flux import FluxAdapter
from diffusiond.models.flux2 import Flux2KleinAdapter
from diffusiond.models.kontext import FluxKontextAdapter
from diffusiond.models.qwenimage import QwenImageAdapter
from diffusiond.models.sd3 import SD3Adapter
from diffusiond.models.sdxl import SDXLAdapter
from diffusiond.models.wan import WanAdapter, WanI2VAdapter
from diffusiond.models.zimage import ZImageAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    cls.pipeline_class: cls
    for cls in (
        SD3Adapter,
        SDXLAdapter,
        FluxAdapter,
        FluxKontextAdapter,
        Flux2KleinAdapter,
        ZImageAdapter,
        QwenImageAdapter,
        WanAdapter,
        WanI2VAdapter,
    )
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


def families_table() -> str:
    """README's table of supported families, from each adapter's declarations (a test keeps README equal to it)."""

    def listed(values) -> str:
        return ", ".join(values) or "-"

    lines = [
        "| `_class_name` | family | output | guidance | parallel | step cache | image inputs | needs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, cls in ADAPTERS.items():
        cells = [
            f"`{name}`",
            cls.family,
            cls.modality,
            listed(cls.guidance_styles),
            listed(cls.parallel),
            listed(cls.cache_methods),
            listed(cls.image_inputs),
            listed(cls.needs),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
