"""`--compile` (kernels/compile.py): the repeated blocks compiled with dynamic shapes during the daemon's warm-up.

After the warm-up's requests, batches of other sizes, with and without CFG, one row alone and another image size
never recompile: dynamo's graph counter does not move after the warm-up (it counts on the engine's step thread too;
`error_on_recompile` does not: dynamo's config set on one thread is not seen on another). The images match the eager
model's, and the counter proves compiled code ran: a `--compile` that compiled nothing would leave it at 0. With
the warm-up cut to its first request, the one-row batch recompiles and this test fails.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch._dynamo
from torch._dynamo.utils import counters

from diffusiond.daemon.app import warm_up_requests
from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.loading.loader import load_adapter
from diffusiond.models.params import SamplingParams

# Inductor's fused kernels sum in another order than eager.
ATOL = 1e-4


async def run(engine: Engine, groups: list[list[SamplingParams]]) -> list[np.ndarray]:
    images = []
    for group in groups:
        handles = [engine.add_request(p) for p in group]
        for handle in handles:
            result = await handle.result()
            assert isinstance(result, Completed), result
            images.append(result.image)
    return images


def serve(adapter, groups, *, warm: bool) -> tuple[list[np.ndarray], int]:
    """The images of `groups`, and how many graphs dynamo compiled while serving them (after any warm-up)."""

    async def main():
        engine = Engine(adapter, max_batch=8, batch_wait=0.3)
        await engine.start()
        try:
            if warm:
                await run(engine, warm_up_requests(adapter.capabilities, compiled=True))
            before = counters["stats"]["unique_graphs"]
            images = await run(engine, groups)
            return images, counters["stats"]["unique_graphs"] - before
        finally:
            await engine.stop()

    return asyncio.run(main())


# FLUX (two kinds of block, rotary embeddings): SD3's blocks are compiled under CFG-parallel in
# tests/engine/test_spmd.py. Each family costs about a minute of CI here.
@pytest.mark.parametrize("family", ["flux"])
def test_compiled_blocks_never_recompile_after_the_warm_up(family, request, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = request.getfixturevalue(f"tiny_{family}")

    def p(seed: int, **kw) -> SamplingParams:
        base = SamplingParams(prompt=f"a shape {seed}", seed=seed, num_inference_steps=3, width=64, height=64)
        return msgspec.structs.replace(base, **kw)

    groups = [
        [p(1)],  # the default guidance, alone
        [p(2, guidance_scale=1.0), p(3, guidance_scale=1.0), p(4, guidance_scale=1.0)],  # no CFG, three rows
        [p(5), p(6), p(7, num_inference_steps=4)],  # three with CFG, different step counts
        [p(8, width=96, height=64)],  # another image size
        [p(9, guidance_scale=1.0)],  # one row: torch specialises size 1, which the warm-up must have compiled
    ]
    expected, _ = serve(load_adapter(model), groups, warm=False)
    torch._dynamo.reset()
    counters.clear()
    adapter = load_adapter(model)
    assert adapter.enable_compile() == {"sd3": 2, "flux": 2}[family]
    got, compiled_while_serving = serve(adapter, groups, warm=True)
    assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])  # compiled code ran, in the warm-up
    assert compiled_while_serving == 0, dict(counters["stats"])  # and nothing after it
    assert any((tmp_path / "inductor").iterdir())  # and its kernels are cached on disk
    for a, b in zip(expected, got, strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() <= ATOL, np.abs(a - b).max()


def test_compile_with_ulysses_is_refused_with_a_reason() -> None:
    from procs import refused

    assert "--compile does not run with --ulysses yet" in refused(
        "serve", "--compile", "--nproc", "2", "--ulysses", "2"
    )
