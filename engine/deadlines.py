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


class AdmissionCosts:
    """What the scheduler reads to admit in chunks (issue 34, part 6): seconds to take a new request in (its prompts
    encoded, its state prepared: the `encode` stage) and seconds of a key's step without that, both exponentially
    weighted averages written by the step thread. While requests run, a step takes in no more new requests than one
    step's time of encoding, so that running requests never wait more than a step's worth of it; at least one, so
    that admission always moves. (A step's time without its encoding: with it, admitting a step's worth would
    lengthen the next estimate, and the next chunk, without bound.) On CUDA a stage's time arrives a few steps late
    (engine/timing.py): new requests are counted until it does."""

    def __init__(self) -> None:
        self.steps = StepTimes()
        # The same per key and rows advanced (key -> rows -> seconds): what a step of fewer rows would take.
        self.by_rows: dict[Hashable, StepTimes] = {}
        self.encode_s: float | None = None
        self._uncounted = 0

    def record(self, key: Hashable | None, seconds: float, new: int, encode_s: float | None, rows: int = 0) -> None:
        """A step of `key` (None: it advanced nothing) took `seconds` in all, advanced `rows` requests and took `new`
        of them in; `encode_s`: the encode time its timings report (None: none yet)."""
        if key is not None:
            step = max(0.0, seconds - (encode_s or 0.0))
            self.steps.record(key, step)
            if rows > 0:
                self.by_rows.setdefault(key, StepTimes()).record(rows, step)
        self._uncounted += new
        if encode_s is None or self._uncounted == 0:
            return
        sample = encode_s / self._uncounted
        self._uncounted = 0
        old = self.encode_s
        self.encode_s = sample if old is None else (1 - ALPHA) * old + ALPHA * sample

    def new_per_step(self, key: Hashable) -> int | None:
        """How many new requests a step of `key` may take in beside running ones; None: not measured yet."""
        step = self.steps.seconds.get(key)
        if step is None or not self.encode_s:
            return None
        return max(1, int(step / self.encode_s))

    def seconds(self, key: Hashable, rows: int) -> float | None:
        """A step of `rows` requests of `key` (`_scaled`); None: `key` never ran."""
        times = self.by_rows.get(key)
        return None if times is None else _scaled(times.seconds, rows)

    def rows_within(self, key: Hashable, budget: float, most: int) -> int:
        """The most rows of `key` (up to `most`, at least 1) whose step is estimated to take `budget` seconds or
        less; `most` before `key` ran."""
        times = self.by_rows.get(key)
        if times is None:
            return most
        return max([1, *(n for n in range(1, most + 1) if _scaled(times.seconds, n) <= budget)])


def _scaled(measured: dict[Hashable, float], rows: int) -> float:
    """A step of `rows` rows from the seconds measured per row count (not empty): as measured, else scaled in
    proportion from the nearest count measured (from below when one is: more rows never take less than that; from
    above, the per-row share of a larger step: what batching saves is not counted)."""
    if rows in measured:
        return measured[rows]
    below = [n for n in measured if n < rows]
    nearest = max(below) if below else min(measured)
    return measured[nearest] * rows / nearest


def estimate_seconds(times: StepTimes, key: Hashable, steps: int, ahead: Sequence[int], max_batch: int) -> float | None:
    per_step = times.of(key)
    if per_step is None:
        return None
    forwards = math.ceil(sum(max(0, s) for s in ahead) / max(1, max_batch)) + steps
    return forwards * per_step
