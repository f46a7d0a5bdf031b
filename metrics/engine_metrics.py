"""The engine's observer, recording into `Metrics`. Called from the step thread; prometheus_client is thread-safe."""

from __future__ import annotations

from diffusiond.metrics.registry import Metrics


class PrometheusObserver:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_step(self, timings: dict[str, float], batch_size: int, advanced: int, reused: int = 0) -> None:
        m = self.metrics
        for stage, seconds in timings.items():
            m.stage_seconds.labels(stage).observe(seconds)
        if batch_size:
            m.batch_size.observe(batch_size)
        m.steps.inc(advanced)
        m.cache_reused.inc(reused)

    def on_counts(self, waiting: int, running: int) -> None:
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(running)

    def on_admitted(self, request_id: str, queue_wait: float, priority: int = 0) -> None:
        self.metrics.queue_wait.observe(queue_wait)
        self.metrics.stage_seconds.labels("queue").observe(queue_wait)
        self.metrics.class_queue_wait.labels(str(priority)).observe(queue_wait)

    def on_first_preview(self, request_id: str, since_submit: float) -> None:
        self.metrics.time_to_first_preview.observe(since_submit)

    def on_paused(self, request_id: str, priority: int, paused: int) -> None:
        self.metrics.preemptions.labels(str(priority)).inc()
        self.metrics.paused.set(paused)

    def on_resumed(self, request_id: str, priority: int, paused: int) -> None:
        self.metrics.paused.set(paused)

    def on_finished(
        self, request_id: str, outcome: str, duration: float, steps_done: int, total_steps: int, priority: int = 0
    ) -> None:
        self.metrics.requests.labels(outcome).inc()
        self.metrics.request_duration.labels(outcome).observe(duration)
        self.metrics.class_request_duration.labels(str(priority), outcome).observe(duration)
