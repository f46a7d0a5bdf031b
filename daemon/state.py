"""The server's state and the app keys every route module reads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from diffusiond.daemon.api import ApiError, NotStarted, retry_later
from diffusiond.daemon.config import ServeConfig
from diffusiond.daemon.tenants import DEFAULT
from diffusiond.engine.engine import Engine, RequestHandle
from diffusiond.engine.outputs import TERMINAL, Cancelled, Completed, Event, Failed, Paused, Progress, Resumed
from diffusiond.metrics.registry import Metrics
from diffusiond.models.params import SamplingParams

log = logging.getLogger(__name__)

MAX_RECORDS = 4096
# A record's statuses before its terminal one ("paused": preempted by a higher class, engine/scheduler.py).
IN_FLIGHT = ("queued", "running", "paused")


@dataclass
class Record:
    """What `GET /v1/generations/{id}` reports."""

    id: str
    created: int
    status: str = "queued"
    step: int = 0
    total: int = 0
    error: str | None = None
    # The tenant that made it (daemon/tenants.py): only it sees or cancels it.
    owner: str = DEFAULT

    def update(self, event: Event) -> None:
        if isinstance(event, Progress | Resumed):
            self.status, self.step = "running", event.step
        elif isinstance(event, Paused):
            self.status, self.step = "paused", event.step
        elif isinstance(event, Completed):
            self.status, self.step = "completed", self.total
        elif isinstance(event, Cancelled):
            self.status, self.error = "cancelled", event.reason
        elif isinstance(event, Failed):
            self.status, self.error = "failed", event.error


@dataclass
class ServerState:
    config: ServeConfig
    model_id: str = ""
    # Every name a request may give in `model`: `model_id` first, then the aliases (`--served-model-name A B`).
    model_names: tuple[str, ...] = ()
    engine: Engine | None = None
    ready: bool = False
    # A restart of an SPMD group (the elastic agent's; daemon/launch.py): what the heal may skip.
    healing: bool = False
    # SIGTERM with --unready-delay: /ready answers 503 (balancers drop us) while requests are still admitted.
    leaving: bool = False
    draining: bool = False
    load_error: str | None = None
    # The load failed on a setting or file the operator gave (exit code 2, as a bad flag), not on the model.
    config_error: bool = False
    # Set once loading ended, ready or failed (`serve.py` then notifies the service manager).
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    records: OrderedDict[str, Record] = field(default_factory=OrderedDict)
    # Per-tenant series (admitted, finished); None in tests that build a bare state.
    metrics: Metrics | None = None
    # Writes each record to the job database when it is made (with the request's parameters) and when it ends
    # (daemon/job_db.py `journal`); None without one.
    journal: Callable[[Record, SamplingParams | None], None] | None = None

    def owned(self, request_id: str, owner: str) -> Record | None:
        """A request's record, if `owner` made it (another tenant's is as unknown as an id never given)."""
        rec = self.records.get(request_id)
        return rec if rec is not None and rec.owner == owner else None

    def usage(self, owner: str) -> tuple[int, int]:
        """(requests in flight, of which waiting to start) of one tenant."""
        steps = self.engine.steps_done if self.engine is not None else {}
        in_flight = waiting = 0
        for rec in self.records.values():
            if rec.owner == owner and rec.status in IN_FLIGHT:
                in_flight += 1
                waiting += rec.status == "queued" and rec.id not in steps
        return in_flight, waiting

    def require_engine(self) -> Engine:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable")
        if self.engine is None or not self.ready:
            reason = "the model failed to load" if self.load_error else "the model is still loading"
            raise retry_later(reason, "unavailable", after=5)
        if not self.engine.alive:
            raise NotStarted("the engine stopped; the server is restarting")
        return self.engine

    def model_named(self, model: str | None) -> str:
        """The name a request gave in `model` when it is one the model is served under (what its answer echoes),
        `model_id` when it gave none; ApiError 404 `model_not_found` naming `model` for another."""
        if model is None:
            return self.model_id
        if model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise ApiError(
                404, f"model {model!r} not found; this server serves {served}", param="model", code="model_not_found"
            )
        return model

    def attach(self, engine: Engine) -> None:
        """Status records follow the engine's events as it delivers them, not as clients read them: a slow reader
        must not make GET say `running` for a request the engine already finished."""
        self.engine = engine
        engine.on_event = self._on_event

    def _on_event(self, event: Event) -> None:
        rec = self.records.get(event.request_id)
        if rec is not None:
            rec.update(event)
            if isinstance(event, TERMINAL) and self.metrics is not None:
                self.metrics.tenant_in_flight.labels(rec.owner).dec()
                self.metrics.tenant_requests.labels(rec.owner, rec.status).inc()
            if isinstance(event, TERMINAL) and self.journal is not None:
                self.journal(rec, None)

    def record(self, handle: RequestHandle, owner: str) -> Record:
        rec = Record(handle.request_id, int(time.time()), total=handle.params.steps_to_run, owner=owner)
        self.records[rec.id] = rec
        if self.metrics is not None:
            self.metrics.tenant_in_flight.labels(owner).inc()
        while len(self.records) > MAX_RECORDS:
            # The oldest finished goes; one in flight stays (its quota counts it, its owner may cancel it): those
            # are bounded by the engine's capacity and the video jobs' own bound, and each goes once it ends.
            old = next((i for i, r in self.records.items() if r.status not in IN_FLIGHT), None)
            if old is None:
                break
            del self.records[old]
        if self.journal is not None:
            self.journal(rec, handle.params)
        return rec

    async def track(self, handle: RequestHandle) -> AsyncIterator[Event]:
        """A request's events; cancels the request if the consumer goes away before its terminal event."""
        finished = False
        try:
            async for event in handle.events():
                finished = isinstance(event, TERMINAL)
                held = [event]
                del event
                yield held.pop()  # kept nowhere here while the consumer works (streaming.py: `handed_on`)
        finally:
            if not finished:
                # The one line a hang-up gets (aiohttp's write errors are not logged as errors).
                log.info("request %s: the client went away; cancelling it", handle.request_id)
                handle.cancel()


STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", Metrics)
# Image encoding threads (image_encoding.encoder_pool).
ENCODERS = web.AppKey("encoders", concurrent.futures.ThreadPoolExecutor)
# How the engine's step thread gets its model (engine.Loader).
LOAD = web.AppKey("load_model", Callable)
