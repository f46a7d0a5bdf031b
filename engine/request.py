"""A request's status in the engine, ordered so that `status.is_finished` is one comparison (as vLLM's
`v1/request.py`). What a request asks for is `models/params.py`'s `SamplingParams`."""

from __future__ import annotations

import enum


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
