"""`make-tiny --real-size`: the real families' transformer configurations (models/tiny/real.py), checked for their
size on the meta device (writing them takes minutes and gigabytes; docs/performance.md has what they measured)."""

from __future__ import annotations

import pytest
import torch
from procs import refused

from diffusiond.models.tiny.real import SD35_MEDIUM, WAN_1_3B


@pytest.mark.parametrize(
    ("config", "cls", "billions"),
    [(SD35_MEDIUM, "SD3Transformer2DModel", 2.24), (WAN_1_3B, "WanTransformer3DModel", 1.42)],
)
def test_real_size_transformers_have_their_size(config, cls, billions):
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, cls)(**config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions


def test_real_size_is_refused_for_families_without_a_layout(tmp_path):
    assert "--real-size is for sd35, wan" in refused(
        "make-tiny", "--family", "flux", "--real-size", "--out", str(tmp_path)
    )
