"""bench/strategies.py times the transformer's work, not its kernel launches (issue 31)."""

from __future__ import annotations

import torch

from diffusiond.bench.strategies import timed


def test_timing_on_a_gpu_waits_for_the_device(monkeypatch):
    """On CUDA a forward returns once its kernels are queued: the timer synchronises before and after the call
    (before: `perf_counter` alone, which on a GPU measures launches). Checked on the CPU with the synchronisation
    recorded."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    seconds: list[float] = []
    fn = timed(lambda x: events.append(("call", x)) or x, "cuda:1", seconds)
    assert fn(3) == 3
    assert events == [("sync", "cuda:1"), ("call", 3), ("sync", "cuda:1")]
    assert len(seconds) == 1
    events.clear()
    assert timed(lambda x: x, "cpu", seconds)(4) == 4 and events == [] and len(seconds) == 2
