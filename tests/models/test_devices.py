"""What would break on the first GPU run, checked on the CPU (issue 31): every tensor reaches a module on that
module's device and dtype.

Broken on purpose once: with the fitted preview map's latents left on the CPU (as before), every family that fits
one at load failed here (on a GPU: a device mismatch in the VAE's first convolution, at start-up)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from diffusiond.models.loading.loader import load_adapter

# Families with no published preview map: they fit one against their VAE when they load.
FITTING = ["tiny_kontext", "tiny_flux2klein", "tiny_qwenimage", "tiny_sdxl", "tiny_wan", "tiny_wan_i2v"]


@pytest.mark.parametrize("fixture", FITTING)
def test_a_fitted_preview_map_decodes_latents_on_the_models_device(fixture, request):
    adapter = load_adapter(request.getfixturevalue(fixture))
    seen = []

    def decode(z: torch.Tensor) -> torch.Tensor:  # the family's VAE decode, as if the model were on "meta"
        seen.append((z.device, z.dtype))
        n, _, h, w = z.shape
        return torch.rand(n, 3, h * adapter.vae_scale_factor, w * adapter.vae_scale_factor) * 2 - 1

    adapter._decode = decode
    adapter.device, adapter.dtype = torch.device("meta"), torch.bfloat16
    fitted = adapter._load_preview_map("a/hub/id")  # not a folder: no stored map, so it is fitted
    assert fitted.source == "fitted"
    assert seen == [(torch.device("meta"), torch.bfloat16)]


def test_sdxl_in_float16_decodes_in_float32_as_its_vae_asks(tiny_sdxl, tmp_path):
    """SDXL's VAE overflows in float16 (NaN images); its pipeline decodes in float32 when the VAE's config says
    `force_upcast` (every SDXL checkpoint's does). Before: the VAE stayed in float16."""
    import json
    import shutil

    model = shutil.copytree(tiny_sdxl, tmp_path / "sdxl")
    config = model / "vae" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "force_upcast": True}))
    adapter = load_adapter(str(model), dtype=torch.float16)
    assert adapter.transformer.dtype == torch.float16
    assert adapter.vae.dtype == torch.float32
    image = adapter._decode(torch.randn(1, 4, 8, 8, dtype=torch.float16) * 30)
    assert image.dtype == torch.float32 and bool(torch.isfinite(image).all())


def decode_calls(adapter, monkeypatch, setting: str, value: int) -> list[int]:
    """The images per VAE call of 5 requests (4 batched, then 1) with models/flowmatch/decoding.py's `setting` at
    `value`; the images equal those decoded with the defaults."""
    from engines import generate

    from diffusiond.models.flowmatch import decoding

    expected = generate(adapter, seeds=(1, 2, 3, 4, 5))
    calls = []
    decode = adapter.vae.decode

    def counted(latents, *args, **kwargs):
        calls.append(latents.shape[0])
        return decode(latents, *args, **kwargs)

    monkeypatch.setattr(adapter.vae, "decode", counted)
    monkeypatch.setattr(decoding, setting, value)
    got = generate(adapter, seeds=(1, 2, 3, 4, 5))
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b).max() <= 1e-5
    return calls


def test_finished_requests_decode_in_calls_of_bounded_size(tiny_sd3, monkeypatch):
    """Requests that finish together are decoded in VAE calls of at most DECODE_PIXELS output pixels each (before:
    all of them in one call, 8 images of 2048 x 2048 at once), and the images are those of one call."""
    assert decode_calls(load_adapter(tiny_sd3), monkeypatch, "DECODE_PIXELS", 2 * 64 * 64) == [2, 2, 1]


def test_on_the_cpu_a_decode_call_stays_under_the_arena_bound(tiny_sd3, monkeypatch):
    """On the CPU a VAE call also decodes at most CPU_DECODE_BYTES of its widest full-size activation (images x
    pixels x the decoder's widest channels x 4 bytes), so that its buffers come from the arenas that keep freed
    memory instead of mappings faulted in at each call; the images are those of one call. Broken on purpose (the
    bound ignored): calls of 4 and 1, red."""
    from diffusiond.models.flowmatch import decoding

    adapter = load_adapter(tiny_sd3)
    each = 64 * 64 * max(adapter.vae.config.block_out_channels[:2]) * 4  # the fixture's 64 x 64 images, float32
    assert decoding.cpu_decode_calls(adapter.vae, 64 * 64) == decoding.CPU_DECODE_BYTES // each
    assert decode_calls(adapter, monkeypatch, "CPU_DECODE_BYTES", 2 * each + 1) == [2, 2, 1]


def test_on_the_cpu_a_2d_vae_convolves_channels_last(tiny_sd3, tiny_wan):
    """On the CPU a 2-D VAE's convolution weights are loaded channels-last (models/loading/pipelines.py
    `channels_last_vae`: one image's decode 0.7-0.8x the time, measured) and it decodes what the checkpoint's layout
    decodes, within float rounding; a 3-D (video) VAE is left as it was. Broken on purpose (the conversion a no-op):
    red."""
    adapter = load_adapter(tiny_sd3)
    convs = [m.weight for m in adapter.vae.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert any(not w.is_contiguous() for w in convs)  # (a 1x1 kernel is both)
    latents = torch.randn(1, adapter.vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        image = adapter._decode(latents)
        adapter.vae.to(memory_format=torch.contiguous_format)
        plain = adapter._decode(latents)
    assert float((image - plain).abs().max()) <= 1e-4
    video = load_adapter(tiny_wan).vae
    assert all(p.is_contiguous() for p in video.parameters())


def test_defaults_on_a_gpu_are_what_runs_there(tmp_path):
    """`--dtype auto` (the default): bfloat16 on CUDA, float32 on the CPU (before: float32 everywhere, so flash-attn
    failed the warm-up and fp8 tripped torchao's assertion); combinations that cannot run are refused at start,
    before any torch import, naming the flag to change."""
    from diffusiond.daemon.config import ServeConfig
    from diffusiond.daemon.startup import model_setup
    from diffusiond.models.loading.setup import ModelSetup, SetupError, check_setup

    assert model_setup(ServeConfig(device="cuda")).dtype == "bfloat16"
    assert model_setup(ServeConfig(device="cuda:3")).dtype == "bfloat16"
    assert model_setup(ServeConfig()).dtype == "float32"
    assert model_setup(ServeConfig(device="cuda", dtype="float16")).dtype == "float16"
    model = str(tmp_path / "absent")
    with pytest.raises(SetupError, match="--quantize fp8 runs in bfloat16: use --dtype bfloat16"):
        check_setup(ModelSetup(model=model, device="cuda", dtype="float16", quantize="fp8"))
    with pytest.raises(SetupError, match="--attention flash runs in float16 or bfloat16 only"):
        check_setup(ModelSetup(model=model, device="cuda", dtype="float32", attention="flash"))
    check_setup(ModelSetup(model=model, device="cuda", dtype="bfloat16", quantize="fp8", attention="flash"))


def test_the_two_lists_of_half_precision_kernels_agree():
    from diffusiond.kernels.attention import HALF_ONLY
    from diffusiond.models.loading.setup import HALF_ONLY_ATTENTION

    assert HALF_ONLY == HALF_ONLY_ATTENTION


def test_row_indices_and_scales_reach_the_device_without_a_sync(monkeypatch):
    """LoRA row plans, step-cache sub-batches and skip-layer guidance send small host lists to the device each step:
    as `torch.tensor(values, device=cuda)` that is a copy the host waits for (a sync per step); now queued."""
    from diffusiond.kernels.host import to_device

    sent = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: sent.append((args, kwargs)) or self)
    assert to_device([1, 2], "cuda:0").tolist() == [1, 2]
    assert sent == [(("cuda:0",), {"non_blocking": True})]
    assert to_device([0.5], "cpu").tolist() == [0.5] and len(sent) == 1


def test_a_fused_lora_is_refused_on_quantized_weights(tiny_sd3, tmp_path):
    from diffusiond.models.loading.setup import ModelSetup, SetupError, check_setup
    from diffusiond.models.tiny.lora import build_tiny_lora

    lora = build_tiny_lora(tiny_sd3, tmp_path / "style.safetensors", seed=1)
    setup = ModelSetup(model=tiny_sd3, lora=(f"style={lora}",), lora_fuse=1.0)
    check_setup(setup)
    with pytest.raises(SetupError, match="--lora-fuse adds the adapter into the weights, which --quantize int8"):
        check_setup(msgspec.structs.replace(setup, quantize="int8"))


def test_a_gpu_layout_needs_the_gpus_it_names(monkeypatch, tmp_path):
    """`--device cuda` where no GPU is visible, and more ranks on a node than its GPUs, are refused at start (before:
    the first failed when the model moved to the device, the second when two ranks shared a GPU's NCCL rank)."""
    from diffusiond.models.loading.setup import ModelSetup, SetupError, check_kernels

    setup = ModelSetup(model=str(tmp_path), device="cuda")
    with pytest.raises(SetupError, match="--device cuda: no CUDA device is visible"):
        check_kernels(setup)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SetupError, match="--nproc 4: each rank needs a GPU of its own and 2 are visible"):
        check_kernels(setup, ranks_here=4)
