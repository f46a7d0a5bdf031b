"""Deadlines (issue 34, part 3): how long a request would take if it were queued now, from step times measured as
the engine runs, so that admission can refuse one its client would not wait for instead of running it for nobody.

The estimate: the forwards ahead of it (the steps left of every request in flight of its class or above, shared
`max_batch` to a forward, as batching shares them at best) and its own steps, at the measured seconds per step of
its batch key (another key's, the slowest measured, before its own has run). It is a lower bound on the wait when
forwards are full, and the right order of magnitude otherwise: a request is refused only when even that is too
late. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

# Weight of a new measurement in the running average of a key's step time.
ALPHA = 0.2


class StepTimes:
    """Seconds per step of each batch key: an exponentially weighted average, written by the step thread, read by
    the event loop (whole dict operations only)."""

    def __init__(self) -> None:
        self.seconds: dict[Hashable, float] = {}

    def record(self, key: Hashable, seconds: float) -> None:
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds

    def of(self, key: Hashable) -> float | None:
        """A key's step time; the slowest measured key's before its own ran; None before anything ran."""
        seconds = self.seconds.get(key)
        if seconds is None:
            seconds = max(list(self.seconds.values()), default=None)
        return seconds


def estimate_seconds(times: StepTimes, key: Hashable, steps: int, ahead: Sequence[int], max_batch: int) -> float | None:
    per_step = times.of(key)
    if per_step is None:
        return None
    forwards = math.ceil(sum(max(0, s) for s in ahead) / max(1, max_batch)) + steps
    return forwards * per_step
