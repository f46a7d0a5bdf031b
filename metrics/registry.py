"""Every Prometheus object of diffusiond. Only rank 0 exports them (`GET /metrics`).

Each `Metrics` owns its own `CollectorRegistry`, so several daemons (or test servers) in one process never collide.

Buckets are chosen for diffusion time scales and documented here:
- `STAGE_BUCKETS` (one stage of one step: a forward, a decode, a broadcast): 0.5 ms to 60 s. A broadcast of a plan
  is sub-millisecond; a forward is milliseconds (tiny models) to seconds (FLUX at 1024 on one GPU); a CPU decode of
  a large image can take tens of seconds.
- `REQUEST_BUCKETS` (whole requests, queue wait, time to first preview): 50 ms to 10 min.
- `BATCH_BUCKETS`: requests sharing one forward, 1 to 64.
- `LAG_BUCKETS`: event-loop lag, 0.5 ms (healthy) to 1 s (a blocked loop).

LoRA adapters (`LoraCollector`) are read from the model's registry at scrape time rather than counted twice; their
per-adapter series are labelled by adapter name, which only the operator chooses (`--lora`, `POST /v1/loras`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Up to an hour: a 14B video model's clip on one GPU takes longer than the 10 minutes these stopped at.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)

# queue: submit -> admitted into a plan; encode: prompt encoding + initial latents of the new requests in a plan;
# denoise: one batched transformer call; sampler: the per-request sampler updates; preview: latent->RGB previews;
# decode: VAE decode of the requests that finished; broadcast: encode + broadcast + decode of the step plan (time
# spent waiting on other ranks shows up here); encode_response: image encoding for the HTTP response.
STAGES = ("queue", "encode", "denoise", "sampler", "preview", "decode", "broadcast", "encode_response")
OUTCOMES = ("completed", "cancelled", "failed")
QUOTAS = ("max_in_flight", "max_queued", "max_stored_jobs", "max_stored_bytes")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.stage_seconds = Histogram(
            "diffusiond_stage_seconds",
            "Seconds spent in one stage of the serving path.",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "diffusiond_request_duration_seconds",
            "Seconds from submission to the terminal event, by outcome.",
            ["outcome"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.time_to_first_preview = Histogram(
            "diffusiond_time_to_first_preview_seconds",
            "Seconds from submission to a request's first preview.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "diffusiond_queue_wait_seconds",
            "Seconds a request waited before joining the running batch.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        # Per priority class (engine/scheduler.py): labels "0" to "9", set by the operator's range, never free text.
        self.class_queue_wait = Histogram(
            "diffusiond_class_queue_wait_seconds",
            "Seconds a request waited before joining the running batch, by its priority class.",
            ["priority"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.class_request_duration = Histogram(
            "diffusiond_class_request_duration_seconds",
            "Seconds from submission to the terminal event, by priority class and outcome.",
            ["priority", "outcome"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "diffusiond_batch_size",
            "Requests sharing one batched denoising forward.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.running = Gauge("diffusiond_requests_running", "Requests in the running batch set.", registry=r)
        self.waiting = Gauge(
            "diffusiond_requests_waiting", "Requests waiting to be admitted (paused ones included).", registry=r
        )
        # Preemption (engine/scheduler.py): pauses by the paused request's class, and how many are paused now.
        self.preemptions = Counter(
            "diffusiond_preemptions",
            "Running requests paused at a step boundary for a higher class, by the paused request's class.",
            ["priority"],
            registry=r,
        )
        self.paused = Gauge("diffusiond_requests_paused", "Requests paused for a higher class now.", registry=r)
        self.requests = Counter(
            "diffusiond_requests", "Requests that reached a terminal status, by outcome.", ["outcome"], registry=r
        )
        self.carried = Counter(
            "diffusiond_requests_carried_over",
            "Requests a failed group had not started, served by this rank 0 on their clients' connections.",
            registry=r,
        )
        self.webhooks = Counter(
            "diffusiond_webhooks",
            "Webhook deliveries of finished jobs (daemon/webhooks.py), by the result of each try.",
            ["result"],
            registry=r,
        )
        self.steps = Counter("diffusiond_steps", "Denoising steps advanced, summed over requests.", registry=r)
        self.cache_reused = Counter(
            "diffusiond_step_cache_reused",
            "Denoising steps that reused their step cache (--cache: transformer blocks skipped), summed over requests.",
            registry=r,
        )
        # Per tenant (daemon/tenants.py): the labels are the tenant names of the operator's file, never a client's.
        self.tenant_requests = Counter(
            "diffusiond_tenant_requests",
            "Requests of a tenant that reached a terminal status, by outcome.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_in_flight = Gauge(
            "diffusiond_tenant_requests_in_flight",
            "Requests of a tenant admitted and not finished.",
            ["tenant"],
            registry=r,
        )
        self.tenant_refusals = Counter(
            "diffusiond_tenant_quota_refusals",
            "Requests refused (429) because a tenant's quota was reached, by quota.",
            ["tenant", "quota"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "diffusiond_event_loop_lag_seconds",
            "How late the event loop woke up from a timed sleep.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.info = Info("diffusiond_model", "The served model and how it runs.", registry=r)
        self.lora = LoraCollector()
        r.register(self.lora)
        self.result_cache = ResultCacheCollector()
        r.register(self.result_cache)
        # Every labelled series exists from the start, so rates and dashboards work before the first event.
        for stage in STAGES:
            self.stage_seconds.labels(stage)
        for outcome in OUTCOMES:
            self.request_duration.labels(outcome)
            self.requests.labels(outcome)

    def add_tenants(self, names: list[str]) -> None:
        """Every series of these tenants, so that they exist before their first request (a reload adds more;
        those of a tenant removed stay until the restart)."""
        for name in names:
            self.tenant_in_flight.labels(name)
            for outcome in OUTCOMES:
                self.tenant_requests.labels(name, outcome)
            for quota in QUOTAS:
                self.tenant_refusals.labels(name, quota)

    def set_info(self, *, model: str, family: str, dtype: str, device: str, world_size: int, version: str) -> None:
        self.info.info(
            {
                "model": model,
                "family": family,
                "dtype": dtype,
                "device": device,
                "world_size": str(world_size),
                "version": version,
            }
        )


class LoraCollector:
    """The LoRA registry's numbers (models/lora/registry.LoraRegistry), read when scraped. The step thread changes the
    registry: this reads whole values only (counters, one copy of its entries, `resident_bytes` over a copy)."""

    def __init__(self) -> None:
        # The served model's registry, once it is loaded (None: no model yet, or one without LoRA).
        self.source: Callable[[], Any] = lambda: None

    def collect(self) -> Iterator[Metric]:
        registry = self.source()
        entries = list(registry.entries.values()) if registry is not None else []
        yield GaugeMetricFamily("diffusiond_lora_adapters", "LoRA adapters registered.", value=len(entries))
        yield GaugeMetricFamily(
            "diffusiond_lora_resident_bytes",
            "Bytes of the LoRA adapters held in memory (at most --lora-cache-bytes, unless requests in flight hold "
            "more).",
            value=registry.resident_bytes if registry is not None else 0,
        )
        yield CounterMetricFamily(
            "diffusiond_lora_loads",
            "LoRA adapters read from their files on use, not being resident (evicted, or over the budget when "
            "registered).",
            value=registry.loads if registry is not None else 0,
        )
        yield CounterMetricFamily(
            "diffusiond_lora_evictions",
            "LoRA adapters dropped from memory to make room for others (--lora-cache-bytes).",
            value=registry.evictions if registry is not None else 0,
        )
        requests = CounterMetricFamily(
            "diffusiond_lora_requests", "Requests that applied a LoRA adapter, by adapter.", labels=["adapter"]
        )
        for entry in entries:
            requests.add_metric([entry.name], entry.requests)
        yield requests


class ResultCacheCollector:
    """The result cache's numbers (engine/result_cache.py), read when scraped."""

    def __init__(self) -> None:
        # The engine's cache, once it runs (None: no engine yet, or the cache is off).
        self.source: Callable[[], Any] = lambda: None

    def collect(self) -> Iterator[Metric]:
        cache = self.source()
        lookups = CounterMetricFamily(
            "diffusiond_result_cache_lookups",
            "Requests with a seed of their client's looked up in the result cache (--result-cache-bytes), by result.",
            labels=["result"],
        )
        lookups.add_metric(["hit"], cache.hits if cache is not None else 0)
        lookups.add_metric(["miss"], cache.misses if cache is not None else 0)
        yield lookups
        yield GaugeMetricFamily(
            "diffusiond_result_cache_bytes",
            "Bytes of the results the cache holds.",
            value=cache.used if cache is not None else 0,
        )
