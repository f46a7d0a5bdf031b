"""Helpers of the step cache tests (tests/models/test_stepcache.py, test_dbcache.py): requests, and an engine that
runs them together in one batch or one after another. On the test path (`pythonpath` in pyproject.toml)."""

from __future__ import annotations

import asyncio

import numpy as np

from diffusiond.engine.engine import Engine
from diffusiond.engine.outputs import Completed
from diffusiond.models.params import SamplingParams

# Batched rows may differ from a row computed alone in the last bits (matmul blocking); as tests/engine/test_batching.
ATOL = 1e-5


def params(seed: int, steps: int = 8, threshold: float | None = None) -> SamplingParams:
    return SamplingParams(
        # Prompts of two lengths: families with texts of their own length (Qwen-Image) batch them padded and masked.
        prompt=f"a shape {seed}" + " on a blue background" * (seed % 2),
        seed=seed,
        width=64,
        height=64,
        num_inference_steps=steps,
        # Each family's default guidance (SD3's CFG 7, FLUX's distilled 3.5; Qwen-Image's is true CFG, which takes a
        # negative prompt, and refuses guidance_scale).
        cache_threshold=threshold,
    )


def count_reuse(monkeypatch) -> list[int]:
    """Every step cache decision from now on, 1 where a request reused (`stepcache.reuse` wrapped for the test)."""
    from diffusiond.models.stepcache import methods as stepcache

    decisions: list[int] = []
    original = stepcache.reuse

    def counting(state, change):
        decisions.append(int(original(state, change)))
        return bool(decisions[-1])

    monkeypatch.setattr(stepcache, "reuse", counting)
    return decisions


async def run(adapter, requests: list[SamplingParams], together: bool) -> list[np.ndarray]:
    engine = Engine(adapter, max_batch=8, batch_wait=0.5 if together else 0.0)
    await engine.start()
    try:
        if together:
            results = await asyncio.gather(*(engine.add_request(p).result() for p in requests))
        else:
            results = [await engine.add_request(p).result() for p in requests]
    finally:
        await engine.stop()
    assert all(isinstance(r, Completed) for r in results), results
    return [r.image for r in results]


async def run_joining(adapter, first: SamplingParams, later: SamplingParams, after: int = 3) -> list[np.ndarray]:
    """`first` alone until it has run `after` steps, then `later` joins its batch: their images."""
    from diffusiond.engine.outputs import Progress

    engine = Engine(adapter, max_batch=8, batch_wait=0.0)
    await engine.start()
    try:
        handle = engine.add_request(first)
        events = handle.events()
        async for event in events:
            if isinstance(event, Progress) and event.step >= after:
                break
        joined = engine.add_request(later)
        results = [await _terminal(events), await joined.result()]
    finally:
        await engine.stop()
    assert all(isinstance(r, Completed) for r in results), results
    return [r.image for r in results]


async def _terminal(events):
    from diffusiond.engine.outputs import TERMINAL

    async for event in events:
        if isinstance(event, TERMINAL):
            return event
    raise AssertionError("no terminal event")


def run_batch(adapter, requests: list[SamplingParams], kept: list | None = None) -> list[Completed]:
    """The requests submitted together (one batch): their results. `kept`, when a list, receives the states the
    adapter prepared, whose step caches the test reads after the run."""

    async def main():
        engine = Engine(adapter, max_batch=max(4, len(requests)), batch_wait=0.5)
        await engine.start()
        try:
            handles = [engine.add_request(p) for p in requests]
            return [await h.result() for h in handles]
        finally:
            await engine.stop()

    if kept is not None:
        prepare = adapter.prepare
        adapter.prepare = lambda pending: kept.extend(prepare(pending)) or kept[-len(pending) :]
    try:
        results = asyncio.run(main())
    finally:
        adapter.__dict__.pop("prepare", None)
    assert all(isinstance(r, Completed) for r in results), results
    return results
