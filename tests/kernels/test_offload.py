"""Offload (kernels/offload.py, `--offload`). There is no GPU here, so these tests check the wiring with the CPU as
the execution device: which components sit on the device during each stage (`model`), that diffusers' group
offloading hooks are on the transformer's layers (`group`), and that the images are exactly the plain ones, with
and without the step cache's forward (which calls the blocks directly). What it saves is measured on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from engines import generate
from procs import refused

from diffusiond.kernels import offload
from diffusiond.models.loading.loader import load_adapter

TEXT = {"text_encoder", "text_encoder_2", "text_encoder_3"}


def test_refusals() -> None:
    offload.check("none", "cpu")
    with pytest.raises(offload.OffloadUnavailable, match="--offload model needs a CUDA device"):
        offload.check("model", "cpu")
    with pytest.raises(offload.OffloadUnavailable, match="unknown offload"):
        offload.check("disk", "cuda")


def cached(model: str, cache: str):
    adapter = load_adapter(model)
    adapter.enable_step_cache(cache, 0.0)
    return adapter


@pytest.mark.parametrize("cache", ["none", "teacache"])
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_model_offload_keeps_one_stage_on_the_device(family, cache, request) -> None:
    model = request.getfixturevalue(f"tiny_{family}")
    expected = generate(cached(model, cache))
    adapter = cached(model, cache)
    adapter.enable_offload("model", "cpu")
    stages = adapter._stages
    seen: dict[str, set[frozenset[str]]] = {"text": set(), "transformer": set(), "vae": set()}

    def watch(kind):
        return lambda module, args: seen[kind].add(stages.resident)

    for name in TEXT & set(stages.components):
        stages.components[name].register_forward_pre_hook(watch("text"))
    adapter.transformer.transformer_blocks[0].register_forward_pre_hook(watch("transformer"))
    adapter.vae.decoder.register_forward_pre_hook(watch("vae"))
    got = generate(adapter)
    text = frozenset(TEXT & set(stages.components))
    assert seen == {"text": {text}, "transformer": {frozenset({"transformer"})}, "vae": {frozenset({"vae"})}}, seen
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cache", ["none", "fbcache"])
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_group_offload_hooks_every_layer_of_the_transformer(family, cache, request) -> None:
    model = request.getfixturevalue(f"tiny_{family}")
    expected = generate(cached(model, cache))
    adapter = cached(model, cache)
    adapter.enable_offload("group", "cpu")
    leaves = [m for m in adapter.transformer.modules() if not list(m.children()) and list(m.parameters())]
    assert leaves and all(getattr(m, "_diffusers_hook", None) is not None for m in leaves)
    assert getattr(adapter.vae, "_diffusers_hook", None) is None  # the rest stays on the device
    got = generate(adapter)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--offload", "group"], "--offload group needs a CUDA device"),
        (["--offload", "model", "--device", "cuda", "--compile"], "--device cuda: no CUDA device is visible"),
        (["--offload", "group", "--device", "cuda", "--compile"], "--compile does not run with --offload group"),
    ],
)
def test_serve_refuses_what_cannot_run_before_loading(flags, message, tmp_path) -> None:
    assert message in refused("serve", *flags, "--model", str(tmp_path / "absent"))
