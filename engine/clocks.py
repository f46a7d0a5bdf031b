"""Per-request clocks on the step thread: when each request was submitted, admitted and first previewed, what the
observer (metrics) hears of it, and the one log line each request gets when it ends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from diffusiond.engine.observer import EngineObserver
from diffusiond.engine.request import RequestStatus
from diffusiond.engine.scheduler import SchedRequest

# One line per finished request; structured fields ride in `extra={"fields": ...}` for the JSON formatter.
request_log = logging.getLogger("diffusiond.requests")


@dataclass
class Clock:
    submitted: float
    # Send a Progress event after every step (streams that show progress); others get none, which spares the event
    # loop a wake-up per step (2% of a request's time on 2 cores); their status comes from `steps_done`.
    progress: bool = True
    admitted: float | None = None
    first_preview: float | None = None
    # The engine's own (the warm-up): no metrics, no request log line.
    internal: bool = False
    # Its class (engine/scheduler.py), a label of the per-class metrics.
    priority: int = 0


class RequestClocks:
    """Step thread only: the clock of every request in flight (perf_counter times)."""

    def __init__(self, observer: EngineObserver) -> None:
        self.observer = observer
        self._clocks: dict[str, Clock] = {}

    def submitted(self, request_id: str, at: float, *, progress: bool, internal: bool, priority: int = 0) -> None:
        self._clocks[request_id] = Clock(at, progress, internal=internal, priority=priority)

    def wants_progress(self, request_id: str) -> bool:
        clock = self._clocks.get(request_id)
        return clock is None or clock.progress

    def only_internal(self) -> bool:
        """Only the engine's own requests in flight (the warm-up, which runs before any user request)."""
        return bool(self._clocks) and all(clock.internal for clock in self._clocks.values())

    def admitted(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            clock = self._clocks.get(request_id)
            if clock is not None:
                clock.admitted = now
                if not clock.internal:
                    self.observer.on_admitted(request_id, now - clock.submitted, clock.priority)

    def previewed(self, request_id: str, now: float) -> None:
        clock = self._clocks.get(request_id)
        if clock is not None and clock.first_preview is None:
            clock.first_preview = now
            if not clock.internal:
                self.observer.on_first_preview(request_id, now - clock.submitted)

    def finished(self, request: SchedRequest, status: RequestStatus) -> None:
        """Metrics and the one log line of a request that reached a terminal status."""
        clock = self._clocks.pop(request.request_id, None)
        if clock is None or clock.internal:
            return
        now = time.perf_counter()
        duration = now - clock.submitted
        queue_wait = (clock.admitted if clock.admitted is not None else now) - clock.submitted
        outcome = status.name.removeprefix("FINISHED_").lower()
        self.observer.on_finished(
            request.request_id, outcome, duration, request.steps_done, request.total_steps, clock.priority
        )
        fields = {
            "request_id": request.request_id,
            "outcome": outcome,
            "steps": request.steps_done,
            "total_steps": request.total_steps,
            "queue_s": round(queue_wait, 4),
            "duration_s": round(duration, 4),
        }
        if clock.first_preview is not None:
            fields["first_preview_s"] = round(clock.first_preview - clock.submitted, 4)
        if request.error:
            fields["error"] = request.error
        request_log.info(
            "request %s %s steps=%d/%d queue=%.3fs total=%.3fs%s",
            request.request_id,
            outcome,
            request.steps_done,
            request.total_steps,
            queue_wait,
            duration,
            f" error={request.error}" if request.error else "",
            extra={"fields": fields},
        )
