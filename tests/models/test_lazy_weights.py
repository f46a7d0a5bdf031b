"""A denoiser built empty and read a part at a time (models/loading/lazy_weights.py) is, once every part is read, the
denoiser `from_pretrained` loads: the same parameters and buffers, names, dtypes and values, no empty tensor left
anywhere (rotary tables kept as plain attributes included), and the same images, for every family (and in bfloat16,
where `_keep_in_fp32_modules` stay float32). Broken on purpose once: with every tensor built in the constructor left
empty, Qwen-Image's rotary table (a plain attribute) stayed on the meta device and its first forward failed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engines import generate

from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.tiny import FAMILIES, GENERIC_FAMILIES


# bfloat16 where it differs: Wan's denoisers keep modules in float32 (`_keep_in_fp32_modules`; wan22 has two),
# SD3 for a denoiser without any. Every dedicated family in float32 (the generic path runs on one rank: no layout
# shards its denoiser).
@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        *((f, "float32") for f in FAMILIES if f not in GENERIC_FAMILIES),
        *((f, "bfloat16") for f in ("sd3", "wan", "wan22")),
    ],
)
def test_read_a_part_at_a_time_equals_from_pretrained(family, dtype, request, tmp_path_factory):
    fixture = {"sd3": "tiny_sd3", "sd35": "tiny_sd35", "sdxl": "tiny_sdxl", "flux": "tiny_flux",
               "flux-kontext": "tiny_kontext", "flux2-klein": "tiny_flux2klein", "flux2": "tiny_flux2",
               "z-image": "tiny_zimage", "ovis-image": "tiny_ovis", "longcat-image": "tiny_longcat",
               "longcat-image-edit": "tiny_longcat_edit", "glm-image": "tiny_glm_image",
               "qwen-image": "tiny_qwenimage", "qwen-image-21": "tiny_qwenimage21",
               "qwen-image-edit-plus": "tiny_qwenimage_edit_plus", "wan": "tiny_wan",
               "qwen-image-edit": "tiny_qwenimage_edit", "qwen-image-layered": "tiny_qwenimage_layered",
               "wan-i2v": "tiny_wan_i2v", "wan22": "tiny_wan22",
               "wan22-i2v": "tiny_wan22_i2v", "wan22-ti2v": "tiny_wan22_ti2v", "ltx2": "tiny_ltx2",
               "ltx2-i2v": "tiny_ltx2_i2v", "hunyuan-video-15": "tiny_hunyuan15",
               "hunyuan-video-15-i2v": "tiny_hunyuan15_i2v", "stable-audio": "tiny_stable_audio"}[family]  # fmt: skip
    model = request.getfixturevalue(fixture)
    whole = load_adapter(model, dtype=dtype).pipe
    adapter = load_adapter(model, dtype=dtype, lazy_denoiser=True)
    assert adapter.device == torch.device("cpu") and adapter.dtype == getattr(whole, adapter.denoiser).dtype
    # Every denoiser of the checkpoint (Wan 2.2 A14B: `transformer_2` as well) is built empty and read a part at a time.
    lazies = dict(adapter.ranks.lazy)
    two = family in ("wan22", "wan22-i2v")
    assert set(lazies) == ({adapter.denoiser, "transformer_2"} if two else {adapter.denoiser})
    for name, lazy in lazies.items():
        module = getattr(adapter.pipe, name)
        assert all(p.device.type == "meta" for p in module.parameters())
        blocks = [block for child in module.children() if isinstance(child, torch.nn.ModuleList)
                  for block in child]  # fmt: skip
        for block in blocks:  # as a layout reads them: block by block, then the rest
            lazy.materialize(block)
        lazy.materialize(module)
        assert lazy.empty() == []
        expected = {**dict(getattr(whole, name).named_parameters()), **dict(getattr(whole, name).named_buffers())}
        got = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        assert set(got) == set(expected)
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and got[key].device == tensor.device, key
            assert torch.equal(got[key], tensor), key
        left = [
            f"{prefix}.{attr}"
            for prefix, part in module.named_modules()
            for attr, value in vars(part).items()
            for t in (value if isinstance(value, (list, tuple)) else [value])
            if isinstance(t, torch.Tensor) and t.is_meta
        ]
        assert left == []
    # Families that need an image (i2v, Qwen-Image-Edit) or take no size (sound) are compared by the tensors above.
    needs_image = (
        "wan-i2v",
        "ltx2-i2v",
        "hunyuan-video-15-i2v",
        "qwen-image-edit",
        "qwen-image-edit-plus",
        "longcat-image-edit",
        "qwen-image-layered",
        "stable-audio",
    )
    if dtype == "float32" and adapter.spec.family not in needs_image:
        for a, b in zip(generate(load_adapter(model)), generate(adapter), strict=True):
            assert np.abs(a - b).max() == 0
