"""Freed memory given back to the system.

glibc keeps what a process frees in its arenas (one per thread that allocates: the step thread, the event loop, the
encoder pool) for reuse, so after a burst of large batches the resident size stays near its high-water mark though
little of it is live; to an operator's RSS graph that looks like a leak. `malloc_trim(0)` returns the free pages of
every arena (madvise). Measured here: ~2 ms when there is nothing to return, ~20 ms to return 370 MB. It runs on
the step thread, where a step would otherwise wait anyway: once the engine has had nothing to run for IDLE_TRIM_S,
and at most every TRIM_EVERY_S while steps keep coming. Where the C library has no malloc_trim (musl), nothing is
done.

Not the moment work runs out: that is when the last request's answer is being encoded (its PNG in the encoder pool,
beside a trim that locks the heap's arenas in turn), and memory given back then is faulted in again by the next
request. Measured on tiny SD3 (256x256, 20 steps, one request at a time over HTTP, three alternated runs of 40
each): p50 146.6-152.1 ms trimming at once, 141.0-142.9 ms not trimming when idle (the PNG's stage 9.2-11.8 vs
7.8-8.5 ms, the decode 16.1-16.8 vs 12.2-15.3 ms); then at once vs after IDLE_TRIM_S, three pairs on a drifting
machine: p50 171.8/147.8/141.8 vs 180.4/139.6/141.2 ms, the PNG's stage 8.1-10.6 vs 7.7-7.8 ms in each pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from diffusiond.kernels.host import malloc_trim

TRIM_EVERY_S = 30.0
# Seconds without work before the freed memory goes back.
IDLE_TRIM_S = 1.0


class Trimmer:
    """When the step thread gives freed memory back: `stepped` after each step; while there is nothing to run, it
    waits at most `idle_wait()` seconds for work and then calls `idle`."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        trim: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float = IDLE_TRIM_S,
    ) -> None:
        self.every_s = every_s
        self.idle_s = idle_s
        self._trim = trim if trim is not None else malloc_trim()
        self._clock = clock
        self._last = clock()
        self._last_step = self._last
        self._stepped = False
        self.trims = 0

    def stepped(self) -> None:
        self._stepped = True
        self._last_step = self._clock()
        if self._last_step - self._last >= self.every_s:
            self._run()

    def idle_wait(self) -> float | None:
        """Seconds until an idle trim is due (0: now); None: none is (nothing ran since the last trim)."""
        if not self._stepped:
            return None
        return max(0.0, self._last_step + self.idle_s - self._clock())

    def idle(self) -> None:
        """Nothing to run: trims once `idle_s` have passed since the last step (and something ran since a trim)."""
        if self.idle_wait() == 0.0:
            self._run()

    def _run(self) -> None:
        self._stepped = False
        self._last = self._clock()
        if self._trim is not None:
            self._trim()
            self.trims += 1
