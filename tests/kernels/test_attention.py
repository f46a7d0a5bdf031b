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
from diffusiond.models.loader import load_adapter

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
