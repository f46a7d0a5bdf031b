"""What the engine reports as it runs, for metrics and logs. The engine calls these from its step thread; an
implementation must be thread-safe and quick (prometheus_client's objects are)."""

from __future__ import annotations

from typing import Protocol


class EngineObserver(Protocol):
    def on_step(self, timings: dict[str, float], batch_size: int, advanced: int, reused: int = 0) -> None:
        """One executed plan: seconds per stage (broadcast, encode, denoise, sampler, preview, decode) and the
        number of requests that shared its forward (0: no forward ran), how many of them advanced a step, and how
        many of those reused their step cache (models/stepcache/methods.py: blocks skipped)."""

    def on_counts(self, waiting: int, running: int) -> None:
        """The scheduler's queue and running set changed size (after a step, an admission or a cancel)."""

    def on_admitted(self, request_id: str, queue_wait: float, priority: int = 0) -> None:
        """A request of class `priority` left the queue (its parameters went out in a plan)."""

    def on_first_preview(self, request_id: str, since_submit: float) -> None: ...

    def on_paused(self, request_id: str, priority: int, paused: int) -> None:
        """A request of class `priority` was paused for a higher class; `paused` are paused now."""

    def on_resumed(self, request_id: str, priority: int, paused: int) -> None:
        """A paused request of class `priority` was admitted again; `paused` are still paused."""

    def on_finished(
        self, request_id: str, outcome: str, duration: float, steps_done: int, total_steps: int, priority: int = 0
    ) -> None:
        """A request reached its terminal status (`outcome`: completed, cancelled or failed) `duration` seconds after
        it was submitted."""


class NullObserver:
    def on_step(self, timings: dict[str, float], batch_size: int, advanced: int, reused: int = 0) -> None:
        pass

    def on_counts(self, waiting: int, running: int) -> None:
        pass

    def on_admitted(self, request_id: str, queue_wait: float, priority: int = 0) -> None:
        pass

    def on_first_preview(self, request_id: str, since_submit: float) -> None:
        pass

    def on_paused(self, request_id: str, priority: int, paused: int) -> None:
        pass

    def on_resumed(self, request_id: str, priority: int, paused: int) -> None:
        pass

    def on_finished(
        self, request_id: str, outcome: str, duration: float, steps_done: int, total_steps: int, priority: int = 0
    ) -> None:
        pass
