"""Per-stage timings of a step, measured where the work happens.

On the CPU a stage's time is the wall time around it. On CUDA the host only launches kernels, so `perf_counter`
around a stage measures launches, not work: stages are bracketed with CUDA events instead, and read back only once
the GPU has passed them (`Event.query()`), so timing never adds a host-device sync to the step. A CUDA stage's time
is therefore reported with a later step's timings (at most a few steps later); histograms do not mind.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any


class HostStages:
    """Wall-clock stage timer (CPU)."""

    def __init__(self) -> None:
        self._times: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds per stage since the last collect."""
        times, self._times = self._times, {}
        return times


class CudaStages:
    """CUDA-event stage timer: no sync on the hot path; stages are reported once the GPU has run them."""

    # Events still pending after this many steps are read with a sync (a GPU this far behind is worth knowing).
    MAX_PENDING = 64

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._pending: deque[tuple[str, Any, Any]] = deque()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        cuda = self._torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record(cuda.current_stream(self._device))
        try:
            yield
        finally:
            end.record(cuda.current_stream(self._device))
            self._pending.append((name, start, end))

    def collect(self) -> dict[str, float]:
        times: dict[str, float] = {}
        while self._pending:
            name, start, end = self._pending[0]
            if not end.query():
                if len(self._pending) <= self.MAX_PENDING:
                    break
                end.synchronize()
            self._pending.popleft()
            times[name] = times.get(name, 0.0) + start.elapsed_time(end) / 1000
        return times


def stage_timer(device: str) -> HostStages | CudaStages:
    return CudaStages(device) if device.startswith("cuda") else HostStages()
