"""The admission window: when nothing runs and requests are arriving, how long the step thread waits for more before
the first step, so that a burst starts (and finishes, and decodes) as one batch instead of a request ahead of the
rest. Pure Python, no I/O: the step thread asks it how long to wait and does the waiting (engine/step_loop.py).

It closes at `max_batch` requests, or once no request arrived for a gap: short (1/40 of the window, all a lone
request pays), or long (1/4) while the clients of requests that finished together in the last second are coming
back. Those come back spread by their answers' encoding, and a round split by a short gap stays split for good (the
late request finishes a step later, so it comes back later): measured on the bundled model, 8 closed-loop clients
got 10% more images/s with the long gap.

While clients are coming back, the window lasts at least one step of the round they finished (`finished_together`):
a request that misses the window waits for the next step boundary anyway (up to a step) and then runs a step behind
the rest, so waiting up to a step for it costs the early ones no more than missing it costs it, and keeps the round
one batch. Measured on tiny SD3 (256x256, 8 closed-loop clients streaming previews, a step 77 ms): the 8 answers'
PNGs come back over more than the 20 ms default, a round split (mean batch 7.6-7.8) and time to first preview was
1.85-2.51 step times; waiting up to a step, every batch was 8 and it was 1.82-1.88.

The returning clients are expected on top of the requests that arrived before their round finished. A round that split
anyway (a return later than the gap) finishes in two halves a step apart: the first half's clients come back while
the second half runs its last step, and wait. Counted among the expected, they closed the window at once, without
the second half's clients, and the round stayed split for good: measured on tiny SD3 after a split, every round
took two admissions, queue waits were 42-55 ms on average, and time to first preview was 2.28-2.37 step
times. Counted on top, the halves join again at the next window.
"""

from __future__ import annotations

# Clients of requests that finished together are expected back within this long.
RETURN_WITHIN_S = 1.0


class AdmissionWindow:
    def __init__(self, wait_s: float, max_batch: int) -> None:
        # Seconds an idle engine waits for a burst of requests to gather; 0: start at once.
        self.wait_s = wait_s
        self.max_batch = max_batch
        # Requests that completed together in the last step that completed several, and when.
        self._returning = 0
        self._returned_at = 0.0
        # Requests that arrived before they finished (waiting then, or on their way in): not among the expected.
        self._early = 0
        self._target = 0  # requests the window waits for: the early ones and the expected ones
        self._deadline = 0.0
        self._span = wait_s
        self._round_step_s = 0.0

    def opens(self, waiting: int, running: int) -> bool:
        """Whether to gather before the next step: requests wait and none runs."""
        return self.wait_s > 0 and waiting > 0 and running == 0

    def start(self, now: float) -> None:
        expected = self._returning if now - self._returned_at < RETURN_WITHIN_S else 0
        self._target = min(self.max_batch, self._early + expected) if expected else 0
        self._span = max(self.wait_s, self._round_step_s) if expected else self.wait_s
        self._deadline = now + self._span

    def next_wait(self, waiting: int, now: float) -> float | None:
        """Seconds to wait for the next arrival with `waiting` requests gathered; None: the window closes."""
        if waiting >= self.max_batch or (self._target and waiting >= self._target):
            return None
        remaining = self._deadline - now
        if remaining <= 0:
            return None
        gap = self._span / 4 if waiting < self._target else self.wait_s / 40
        return min(gap, remaining)

    def close(self) -> None:
        self._returning = 0

    def finished_together(self, completed: int, now: float, step_s: float | None = None, waiting: int = 0) -> None:
        """A step completed `completed` requests, with `waiting` requests in the queue: several coming back together
        are worth waiting for (on top of those that arrived before), up to `step_s` (their steps' time, if measured)
        when that is longer than the window."""
        if completed > 1:
            self._returning = min(completed, self.max_batch)
            self._returned_at = now
            self._round_step_s = step_s or 0.0
            self._early = waiting

    def arrived(self, submitted: float) -> None:
        """A request submitted at `submitted` joined the queue."""
        if submitted < self._returned_at:
            self._early += 1
