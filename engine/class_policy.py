"""How priority classes share the steps (engine/scheduler.py's classes): aging, and short steps beside a higher class.

Aging bounds the wait of a low class: a request's effective class rises by one for every `aging_steps` steps served
to a higher class (as asked) while it waited (to be admitted, or, running, to be advanced), up to the highest class
in flight (it catches up, never overtakes), so a request of class p competes in the top class t after at most
(t - p) * aging_steps steps of higher classes' work, and is served from there (admitted by fair share, then age;
advanced by the round robin). A wait behind its own class (a queue of long clips) is no starvation and ages no one:
otherwise a flood's own queue lifts it into the interactive class (measured: a tiny Wan flood waiting a second behind
itself competed with class 9 at 3.4x its idle p99).

Short steps beside a higher class: preemption acts at step boundaries, so a request of a higher class that arrives
while a step of a lower class runs waits for that step (measured on the bundled model under a flood: 4 rows at 64x64,
53-64 ms a step, against 13 ms for one; its tail was idle plus such a step). For `class_window_s` after a class was
last in flight, a step of a lower class carries only the rows estimated (per key and row count, as measured) to take
about one lone step of that class (or of its own key, when longer), at least one; the others sit out in turn (least
recently advanced first). Where a full batch takes about a lone step's time (a GPU at small sizes) the batch stays
full; where time grows with rows (the bundled model on this CPU: 4 rows 4x one) the lower class runs a row at a
time while the higher class is active (measured: 14% fewer flood steps a second than in full steps).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from diffusiond.engine.deadlines import AdmissionCosts
from diffusiond.engine.request import SchedRequest

MAX_PRIORITY = 9
# Steps a request waits per class it rises (issue 34's aging; `--priority-aging-steps`).
AGING_STEPS = 20
# Seconds after a request of a higher class was in flight that a lower class's steps stay short (`--class-window-ms`).
CLASS_WINDOW_S = 2.0
# How far over a higher class's lone step a short step of a lower class may be estimated to go.
SHORT_STEP_SLACK = 1.25


class Aging:
    """Aging's clock, per class: the steps whose forward served a higher class (as asked). A wait behind one's own
    class (a queue of long clips) or behind decoding is no starvation, and ages no one."""

    def __init__(self, steps: int = AGING_STEPS) -> None:
        if steps < 1:
            raise ValueError(f"aging_steps must be >= 1, got {steps}")
        self.steps = steps
        self.above = [0] * (MAX_PRIORITY + 1)
        # The highest class asked for by a request in flight (aging's ceiling), as of the last `ceiling_of`.
        self.ceiling = 0

    def ceiling_of(self, requests: Iterable[SchedRequest]) -> None:
        self.ceiling = max((r.priority for r in requests), default=0)

    def effective(self, req: SchedRequest) -> int:
        """Its class, raised by one for every `steps` steps served to a higher class while it waited (to be
        admitted, or to advance), up to the highest class asked for now: aging lets a low class catch up, never
        overtake, so that within a class, fair share (not age) orders admissions. At least the class it ran at."""
        return max(self.aged(req), req.floor)

    def aged(self, req: SchedRequest) -> int:
        """Its class as asked, raised by its wait (not by the class it ran at: a decode is no step)."""
        held = max(0, self.above[req.priority] - req.held_since)
        return min(max(req.priority, self.ceiling), req.priority + held // self.steps)

    def restart(self, req: SchedRequest) -> None:
        """Its wait, for aging, starts now."""
        req.held_since = self.above[req.priority]

    def served(self, rank: int) -> None:
        """A step served class `rank`: every lower class waited it out."""
        for lower in range(rank):
            self.above[lower] += 1


class ShortSteps:
    """Which classes were in flight lately (class -> (when, a key of its)), and the rows a lower class's step may
    carry beside them."""

    def __init__(self, window_s: float = CLASS_WINDOW_S) -> None:
        self.window_s = window_s
        self.recent: dict[int, tuple[float, Hashable]] = {}

    def seen(self, requests: Iterable[SchedRequest], now: float) -> None:
        for req in requests:
            self.recent[req.priority] = (now, req.key)

    def rows(self, costs: AdmissionCosts | None, key: Hashable, rank: int, now: float, max_batch: int) -> int:
        """Requests a step of `key` at class `rank` may carry: `max_batch`; or, within `window_s` of a higher class
        in flight, as many as are estimated to take about as long as one lone step of the highest such class, or of
        `key` itself when that is longer (measured: `costs`; at least one), so that its next request waits at most
        about that long for a step in progress. Where a full batch takes about a lone step's time (a GPU; a small
        model whose fixed costs dominate), that is the full batch: fewer rows would cost throughput and save no
        wait."""
        if costs is None or self.window_s <= 0:
            return max_batch
        above = [(c, k) for c, (seen, k) in self.recent.items() if c > rank and now - seen <= self.window_s]
        if not above:
            return max_batch
        lone = costs.seconds(max(above, key=lambda ck: ck[0])[1], 1)
        if lone is None:
            return max_batch
        budget = max(lone, costs.seconds(key, 1) or 0.0)
        return costs.rows_within(key, budget * SHORT_STEP_SLACK, max_batch)
