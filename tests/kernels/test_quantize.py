"""Quantization of the transformer's linear layers with torchao (kernels/quantize.py, `--quantize`).

Parity is approximate by nature; the bound below is stated against the unquantized image of the same request. A
quantizer that converted nothing would give the unquantized image exactly: the tests require the weights to be
torchao's quantized tensors and the image to differ (and to stay within the bound). fp8 needs a GPU of compute
capability 8.9+, so here it is only refused.
"""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
from engines import generate
from procs import refused

from diffusiond.daemon.config import QuantizeChoice
from diffusiond.kernels import quantize
from diffusiond.models.loading.loader import load_adapter

# Mean absolute difference from the unquantized image, in [0, 1] pixel units, of the tiny random checkpoints at 3
# steps. Measured: see the test's print; random weights are far more sensitive to rounding than trained ones
# (README's table has the bundled model's PSNR and judge accuracy).
MAX_MEAN_ABS = 0.005


def test_choices_match_the_config() -> None:
    assert get_args(QuantizeChoice) == quantize.CHOICES


def test_refusals(monkeypatch) -> None:
    quantize.check("none", "cpu")
    quantize.check("int8", "cpu")
    with pytest.raises(quantize.QuantizationUnavailable, match="--quantize fp8 needs a CUDA device"):
        quantize.check("fp8", "cpu")
    with pytest.raises(quantize.QuantizationUnavailable, match="unknown quantization"):
        quantize.check("int4", "cpu")
    monkeypatch.setattr(quantize, "find_spec", lambda name: None)
    with pytest.raises(quantize.QuantizationUnavailable, match=r"needs torchao: pip install 'diffusiond\[quant\]'"):
        quantize.check("int8", "cpu")


@pytest.mark.parametrize("choice", ["int8", "int8-dynamic"])
@pytest.mark.parametrize("family", ["sd3", "flux", "qwenimage", "zimage"])
def test_quantized_layers_serve_close_to_the_exact_image(family, choice, request) -> None:
    model = request.getfixturevalue(f"tiny_{family}")
    expected = generate(load_adapter(model))
    adapter = load_adapter(model, quantize=choice)
    layers = dict(adapter.transformer.named_modules())
    names = quantize.selected(adapter.transformer)
    assert adapter.quantized == (choice, len(names)) and len(names) > 0
    assert all(quantize.is_quantized(layers[n].weight) for n in names)
    # The default skip list: embedders, the final norm and the output projection stay as loaded.
    kept = [n for n, m in layers.items() if hasattr(m, "weight") and n not in names and type(m).__name__ == "Linear"]
    assert kept and all(not quantize.is_quantized(layers[n].weight) for n in kept)
    assert any("embed" in n for n in kept) and ("proj_out" in kept or any("final_layer" in n for n in kept))
    got = generate(adapter)
    for a, b in zip(expected, got, strict=True):
        mean_abs = float(np.abs(a - b).mean())
        print(f"{family} {choice}: mean |difference| {mean_abs:.2e}, max {np.abs(a - b).max():.2e}")
        assert 0 < mean_abs <= MAX_MEAN_ABS


def test_skip_patterns_leave_layers_alone(tiny_sd3) -> None:
    adapter = load_adapter(tiny_sd3, quantize="int8", quantize_skip="*")
    assert adapter.quantized == ("int8", 0)
    adapter = load_adapter(tiny_sd3, quantize="int8", quantize_skip="transformer_blocks.0.*")
    quantized = quantize.selected(adapter.transformer, ("transformer_blocks.0.*",))
    assert adapter.quantized[1] == len(quantized) and not any(n.startswith("transformer_blocks.0.") for n in quantized)


def test_a_served_model_is_quantized(serve) -> None:
    import urllib.request

    server = serve(quantize="int8")
    adapter = server.state.engine.adapter
    assert adapter.quantized is not None and adapter.quantized[1] > 0
    body = b'{"prompt": "a shape", "seed": 1, "num_inference_steps": 2, "response_format": "b64_json"}'
    request = urllib.request.Request(
        f"{server.base_url}/v1/images/generations", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_fp8_is_refused_on_a_cpu_before_loading(command, tmp_path) -> None:
    args = ["serve"] if command == "serve" else ["generate", "a red circle", "--out", str(tmp_path / "x.png")]
    assert "--quantize fp8 needs a CUDA device" in refused(
        *args, "--quantize", "fp8", "--model", str(tmp_path / "absent")
    )
