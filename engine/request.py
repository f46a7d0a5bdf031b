"""A request as the scheduler keeps it: its status, ordered so that `status.is_finished` is one comparison (as vLLM's
`v1/request.py`), its record (`SchedRequest`), and what an executed plan reports back (`StepResult`). What a request
asks for is `models/params.py`'s `SamplingParams`."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

from diffusiond.models.params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_COMPLETED = 3
    FINISHED_CANCELLED = 4
    FINISHED_FAILED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_COMPLETED


@dataclass(eq=False)
class SchedRequest:
    request_id: str
    params: SamplingParams
    # What must match to share a forward (size, CFG on/off, ...); decided by the model adapter.
    key: Hashable
    total_steps: int
    status: RequestStatus = RequestStatus.WAITING
    steps_done: int = 0
    arrival: int = 0
    last_advanced: int = -1
    cancel_requested: bool = False
    error: str | None = None
    # Its class (0-MAX_PRIORITY, higher first), and who asked (fair share by weight).
    priority: int = 0
    tenant: str = ""
    weight: float = 1.0
    # Where the scheduler's count of steps served above its class stood when its wait began (added, paused, last
    # advanced; decoding: last able to run): for aging.
    held_since: int = 0
    # When its client stops waiting (perf_counter seconds; None: no deadline): earlier first within a class.
    deadline: float | None = None
    # The effective class it was admitted at: it keeps it while it runs (and when paused and admitted again).
    floor: int = 0
    # Times it was paused; and whether it is paused now (every rank holds its state, out of the batch).
    pauses: int = 0
    parked: bool = False
    # The computation it shares with the requests admitted beside it (`shares_calls`: a generic pipeline's call),
    # named by the step that admitted them; None for a request that shares none.
    call: int | None = None

    @property
    def work(self) -> int:
        """What one step of it costs, in pixel-frames."""
        p = self.params
        return (p.width or 1) * (p.height or 1) * (p.num_frames or 1)


@dataclass
class StepResult:
    """What one executed plan reports back (rank 0's view), in scheduler terms."""

    advanced: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    # Finished their steps with this plan, their decode not (pieces left); and the requests whose image this plan
    # made (those decoding end with it).
    decoding: list[str] = field(default_factory=list)
    decoded: list[str] = field(default_factory=list)
    # Requests whose steps turned out other than their parameters said (a generic call's), by id.
    totals: dict[str, int] = field(default_factory=dict)
