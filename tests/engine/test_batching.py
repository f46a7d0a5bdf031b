"""Step-level batching does what it claims: requests that share a batch key share one transformer forward.

Equality of images cannot show this (one forward per request gives the same images), so the transformer's calls and
their rows are counted. Replacing the batched `denoise` by one call per request makes this test fail.
"""

import threading

import numpy as np
import pytest

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.engine.request import SamplingParams
from diffusiond.models.loader import load_adapter

STEPS = 3


@pytest.fixture(scope="module")
def adapter(tiny_sd3):
    return load_adapter(tiny_sd3)


def params(seed: int, prompt: str = "a red circle", steps: int = STEPS, guidance: float = 5.0) -> SamplingParams:
    return SamplingParams(
        prompt=prompt, seed=seed, width=64, height=64, num_inference_steps=steps, guidance_scale=guidance
    )


@pytest.mark.asyncio
async def test_requests_of_one_key_share_each_forward(adapter, monkeypatch):
    calls: list[int] = []  # rows of each transformer call
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    # A one-step blocker of another batch key (no CFG: one row) holds the step thread while the four requests queue,
    # so all four are admitted together.
    release = threading.Event()
    real = adapter.denoise

    def denoise(states):
        if states[0].params.prompt == "blocker":
            release.wait(10)
        return real(states)

    monkeypatch.setattr(adapter, "denoise", denoise)
    engine = Engine(adapter, max_batch=4)
    await engine.start()
    try:
        blocker = engine.add_request(params(99, prompt="blocker", steps=1, guidance=1.0))
        handles = [engine.add_request(params(seed)) for seed in range(4)]
        release.set()
        assert isinstance(await blocker.result(), Completed)
        results = [await h.result() for h in handles]
        alone = [await engine.add_request(params(seed)).result() for seed in range(2)]
    finally:
        await engine.stop()
        hook.remove()
    assert all(isinstance(r, Completed) for r in results)
    # The blocker's one row; four requests x 3 steps: 3 forwards of 4 requests x 2 CFG rows; then 2 x 3 forwards of
    # one request alone.
    assert calls == [1] + [8] * STEPS + [2] * (2 * STEPS), calls
    # And batching changed nothing.
    for batched, single in zip(results, alone, strict=False):
        np.testing.assert_allclose(batched.image, single.image, atol=1e-5)
