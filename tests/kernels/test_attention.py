"""One attention-backend selector (kernels/attention.py), applied through diffusers' attention dispatch.

On this CPU, `math` (SDPA's reference kernel, dispatched by diffusers) stands for every non-default backend: the
images match SDPA's, and a counter on the dispatched kernel proves the layers really went through it (a selector
that set nothing would leave the counter at 0). GPU-only backends are refused before anything loads.
"""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from engines import generate
from procs import refused

from diffusiond.daemon.config import AttentionChoice
from diffusiond.kernels import attention
from diffusiond.models.loading.loader import load_adapter

# Kernels differ in summation order only.
ATOL = 1e-5


def count_calls(monkeypatch, backend: str) -> list[int]:
    """Counts the dispatched calls of `backend` (one of our names)."""
    name = AttentionBackendName(attention.BACKENDS[backend])
    kernel = _AttentionBackendRegistry._backends[name]
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, counted)
    return calls


def test_choices_match_the_config() -> None:
    assert get_args(AttentionChoice) == attention.CHOICES


def test_auto_is_sdpa_on_a_cpu_and_gpu_backends_are_refused() -> None:
    assert attention.resolve("auto", "cpu") == "sdpa"
    assert attention.resolve("math", "cpu") == "math"
    for backend in ("flash", "sage", "xformers", "cudnn", "efficient", "flash3"):
        with pytest.raises(attention.AttentionUnavailable, match=f"--attention {backend} needs a CUDA device"):
            attention.resolve(backend, "cpu")
    with pytest.raises(attention.AttentionUnavailable, match="not a backend"):
        attention.resolve("fastest", "cpu")


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_a_chosen_backend_runs_every_layer_and_changes_no_image(family, request, monkeypatch) -> None:
    model = request.getfixturevalue(f"tiny_{family}")
    plain = load_adapter(model)
    assert plain.set_attention("auto") == "sdpa"
    expected = generate(plain)
    calls = count_calls(monkeypatch, "math")
    adapter = load_adapter(model)
    assert adapter.set_attention("math") == "math"
    layers = sum(1 for m in adapter.transformer.modules() if hasattr(m, "processor"))
    got = generate(adapter)
    # Every attention layer, every forward: 3 steps x (2 requests batched in one forward) -> 3 forwards.
    assert calls[0] == 3 * layers, (calls[0], layers)
    for a, b in zip(expected, got, strict=True):
        assert np.abs(a - b).max() <= ATOL


def test_a_served_model_attends_with_the_configured_backend(serve, monkeypatch) -> None:
    """`serve --attention math`: the daemon sets it on the model before its warm-up and serves through it."""
    import urllib.request

    calls = count_calls(monkeypatch, "math")
    server = serve(attention="math")
    assert server.state.engine.adapter.attention_backend == "math"
    warm_up_calls = calls[0]
    assert warm_up_calls > 0
    body = b'{"prompt": "a shape", "seed": 1, "num_inference_steps": 2, "response_format": "b64_json"}'
    request = urllib.request.Request(
        f"{server.base_url}/v1/images/generations", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    assert calls[0] > warm_up_calls


def test_serve_refuses_a_backend_it_cannot_run_before_loading(tmp_path) -> None:
    stderr = refused("serve", "--attention", "flash", "--model", str(tmp_path / "absent"))
    assert "--attention flash needs a CUDA device" in stderr


def test_generate_refuses_a_backend_it_cannot_run_before_loading(tmp_path) -> None:
    stderr = refused("generate", "a red circle", "--attention", "sage", "--out", str(tmp_path / "x.png"))
    assert "--attention sage needs a CUDA device" in stderr
    assert not (tmp_path / "x.png").exists()


def pretend_installed(monkeypatch, requirements_pass: bool = True) -> None:
    """As if flash-attn (and the others) were installed, and diffusers' version checks passed or not."""
    import importlib.util

    from diffusers.models import attention_dispatch

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if "attn" in name else find_spec(name, *a)
    )

    def check(backend):
        if not requirements_pass:
            raise RuntimeError(f"{backend.value} needs flash-attn >= 2.6.3")

    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", check)


def test_auto_picks_flash_only_where_it_runs(monkeypatch) -> None:
    """flash-attn takes fp16/bf16 only: `auto` on a GPU in float32 is SDPA (before: flash, which failed the warm-up),
    and an installed flash-attn that diffusers' own check refuses (too old) is not picked either."""
    import torch

    pretend_installed(monkeypatch)
    assert attention.resolve("auto", "cuda", torch.bfloat16) == "flash"
    assert attention.resolve("auto", "cuda", torch.float16) == "flash"
    assert attention.resolve("auto", "cuda", torch.float32) == "sdpa"
    assert attention.resolve("auto", "cpu", torch.bfloat16) == "sdpa"
    with pytest.raises(attention.AttentionUnavailable, match="float16 or bfloat16 only; the model is float32"):
        attention.resolve("flash", "cuda", torch.float32)
    pretend_installed(monkeypatch, requirements_pass=False)
    assert attention.resolve("auto", "cuda", torch.bfloat16) == "sdpa"
    with pytest.raises(attention.AttentionUnavailable, match=r"needs flash-attn >= 2\.6\.3"):
        attention.resolve("flash", "cuda", torch.bfloat16)


def test_a_masked_call_never_reaches_a_kernel_that_refuses_masks(tiny_qwenimage, monkeypatch) -> None:
    """Qwen-Image masks the padding of texts of different lengths in one batch (here a negative prompt, true CFG).
    flash-attn refuses masks (diffusers raises "`attn_mask` is not supported for flash-attn 2"): under `flash` its
    layers dispatch to flash-attn's varlen kernel, which takes the key-padding mask. On this CPU both kernels are
    stand-ins with the real ones' contract (the plain one raises on a mask; the varlen one runs SDPA's reference
    kernel), and the images equal SDPA's. Broken on purpose: without `masked`, every layer went to the plain kernel
    and the first masked forward raised."""
    import asyncio

    from diffusiond.engine.engine import Engine
    from diffusiond.engine.outputs import Completed
    from diffusiond.models.params import SamplingParams

    math = _AttentionBackendRegistry._backends[AttentionBackendName._NATIVE_MATH]
    masks = []

    def flash(query, key, value, attn_mask=None, **kwargs):
        if attn_mask is not None:
            raise ValueError("`attn_mask` is not supported for flash-attn 2.")
        return math(query, key, value, **kwargs)

    def flash_varlen(query, key, value, attn_mask=None, **kwargs):
        masks.append(attn_mask is not None and not bool(attn_mask.all()))
        return math(query, key, value, attn_mask=attn_mask, **kwargs)

    requests = [
        SamplingParams(prompt="a red shape", negative_prompt="blurry, dark, low quality, noisy, ugly", seed=1,
                       true_cfg_scale=4.0, width=64, height=64, num_inference_steps=2),
        SamplingParams(prompt="a very long description of a small blue square on a white floor", seed=2,
                       width=64, height=64, num_inference_steps=2),
    ]  # fmt: skip

    def run(adapter) -> list:
        async def go():
            engine = Engine(adapter, max_batch=4, batch_wait=0.5)  # both in every forward
            await engine.start()
            try:
                results = [await h.result() for h in [engine.add_request(p) for p in requests]]
            finally:
                await engine.stop()
            assert all(isinstance(r, Completed) for r in results), results
            return [r.image for r in results]

        return asyncio.run(go())

    expected = run(load_adapter(tiny_qwenimage))
    for name, kernel in (("FLASH", flash), ("FLASH_VARLEN", flash_varlen)):
        monkeypatch.setitem(_AttentionBackendRegistry._backends, AttentionBackendName[name], kernel)
        monkeypatch.setitem(
            _AttentionBackendRegistry._supported_arg_names,
            AttentionBackendName[name],
            _AttentionBackendRegistry._supported_arg_names[AttentionBackendName._NATIVE_MATH],
        )
    adapter = load_adapter(tiny_qwenimage)
    monkeypatch.setattr(attention, "resolve", lambda choice, device, dtype=None: choice)  # as on a GPU
    assert adapter.set_attention("flash") == "flash"
    got = run(adapter)
    assert any(masks), "no masked call reached the varlen kernel"
    for a, b in zip(expected, got, strict=True):
        assert np.abs(a - b).max() <= ATOL


def test_a_unet_that_calls_sdpa_itself_says_so(tiny_sdxl) -> None:
    """SDXL's UNet calls SDPA itself: `auto` reports sdpa (before: "attention: flash" was logged while SDPA ran),
    and a backend chosen by name is refused at start."""
    from diffusiond.models.loading.setup import SetupError

    adapter = load_adapter(tiny_sdxl)
    assert adapter.set_attention("auto") == "sdpa"
    with pytest.raises(SetupError, match="--attention math: the sdxl family's attention runs SDPA only"):
        adapter.set_attention("math")
