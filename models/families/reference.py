"""The reference design's acceleration table (vLLM-Omni's diffusion engine, as issue 52 lists it), cell for cell
against what our families declare (models/families/specs.py): docs/families.md carries `reference_table()`'s
output, and a test keeps the two equal. A cell the reference marks and we do not serve says why.
"""

from __future__ import annotations

from diffusiond.models.families.specs import FAMILIES

# (reference row, the pipeline classes it names, the columns the reference marks).
COLUMNS = ("TeaCache", "Cache-DiT", "Ulysses", "Ring", "CFG-parallel", "TP", "VAE patch")
ROWS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("Qwen-Image, Qwen-Image-2512", ("QwenImagePipeline",), COLUMNS),
    ("Qwen-Image-Edit, -2509", ("QwenImageEditPipeline", "QwenImageEditPlusPipeline"), COLUMNS[:6]),
    ("Qwen-Image-Layered", ("QwenImageLayeredPipeline",), COLUMNS[1:6]),
    ("Z-Image", ("ZImagePipeline",), ("TeaCache", "Cache-DiT", "TP", "VAE patch")),
    ("SD3.5", ("StableDiffusion3Pipeline",), ("Cache-DiT", "CFG-parallel")),
    ("FLUX.1-dev", ("FluxPipeline",), ("Cache-DiT", "CFG-parallel", "TP")),
    ("FLUX.1 Kontext", ("FluxKontextPipeline",), ("Cache-DiT",)),
    ("FLUX.2 klein", ("Flux2KleinPipeline",), ("TeaCache", "Cache-DiT", "TP")),
    ("FLUX.2 dev", ("Flux2Pipeline",), ("Cache-DiT", "TP")),
    ("LongCat-Image, -Edit", ("LongCatImagePipeline", "LongCatImageEditPipeline"), ("Cache-DiT", "CFG-parallel", "TP")),
    ("Ovis-Image", ("OvisImagePipeline",), ("Cache-DiT", "CFG-parallel")),
    ("GLM-Image", ("GlmImagePipeline",), ("CFG-parallel", "TP")),
    ("Wan 2.1 T2V, Wan 2.2 A14B", ("WanPipeline",), COLUMNS[1:]),
    ("LTX-2", ("LTX2Pipeline",), ("Cache-DiT", "Ulysses", "Ring", "CFG-parallel")),
    ("Stable Audio Open", ("StableAudioPipeline",), ("TeaCache",)),
)

GENERIC_ONLY = "served on the generic path (its own call, one rank, no step cache): no dedicated family yet"
# Why a row without a family of ours is not served as the reference serves it (else GENERIC_ONLY).
WHY_ROW: dict[str, str] = {}
# Why a cell the reference marks is not served by the family that serves the row.
WHY_NOT: dict[tuple[str, str], str] = {}


def served(pipeline_class: str, column: str) -> bool:
    """Whether the family of `pipeline_class` serves the reference's `column` (TP: TP, or HSDP for Wan's row)."""
    f = FAMILIES.get(pipeline_class)
    if f is None:
        return False
    return {
        "TeaCache": "teacache" in f.cache_methods,
        "Cache-DiT": "dbcache" in f.cache_methods,  # DBCache with TaylorSeer and SCM: Cache-DiT's methods
        "Ulysses": "ulysses" in f.parallel,
        "Ring": "ring" in f.parallel,
        "CFG-parallel": "cfg-parallel" in f.parallel,
        "TP": "tp" in f.parallel or (f.modality == "video" and "shard-weights" in f.parallel),
        "VAE patch": "vae-parallel" in f.parallel,
    }[column]


def reference_table() -> str:
    """Markdown: a row per reference row, a column per acceleration; "yes" where we serve what the reference marks,
    "also" where we serve more than it marks, the reason where we do not."""
    lines = ["| model | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    reasons: list[str] = []
    for name, classes, marked in ROWS:
        cells = []
        for column in COLUMNS:
            ours = all(served(c, column) for c in classes)
            if ours:
                cells.append("yes" if column in marked else "also")
            elif column not in marked:
                cells.append("-")
            else:
                why = next((WHY_NOT[(c, column)] for c in classes if (c, column) in WHY_NOT), None)
                if why is None:  # a row without a family: one reason for all its cells
                    why = next((WHY_ROW[c] for c in classes if c in WHY_ROW), GENERIC_ONLY)
                    note = f"{name}: {why}"
                else:
                    note = f"{name}, {column}: {why}"
                if note not in reasons:
                    reasons.append(note)
                cells.append(f"no ({reasons.index(note) + 1})")
        lines.append(f"| {name} (`{'`, `'.join(classes)}`) | " + " | ".join(cells) + " |")
    notes = [f"({i}) {text}" for i, text in enumerate(reasons, start=1)]
    if not notes:  # every marked cell served
        return "\n".join(lines) + "\n"
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
