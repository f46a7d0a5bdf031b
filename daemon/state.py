"""The server's state and the app keys every route module reads."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.config import ServeConfig
from diffusiond.engine.engine import Engine, RequestHandle
from diffusiond.engine.outputs import TERMINAL, Cancelled, Completed, Event, Failed, Progress
from diffusiond.metrics.registry import Metrics
from diffusiond.models.base import ModelAdapter

MAX_RECORDS = 4096


@dataclass
class Record:
    """What `GET /v1/generations/{id}` reports."""

    id: str
    created: int
    status: str = "queued"
    step: int = 0
    total: int = 0
    error: str | None = None

    def update(self, event: Event) -> None:
        if isinstance(event, Progress):
            self.status, self.step = "running", event.step
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
    engine: Engine | None = None
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    # Set once loading ended, ready or failed (`serve.py` then notifies the service manager).
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    records: OrderedDict[str, Record] = field(default_factory=OrderedDict)
    _settling: set[asyncio.Task] = field(default_factory=set)

    def require_engine(self) -> Engine:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable")
        if self.engine is None or not self.ready:
            reason = f"model failed to load: {self.load_error}" if self.load_error else "model is still loading"
            raise ApiError(503, reason, type="server_error", code="unavailable", headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise ApiError(503, f"engine stopped: {self.engine.error!r}", type="server_error", code="unavailable")
        return self.engine

    def record(self, handle: RequestHandle) -> Record:
        rec = Record(handle.request_id, int(time.time()), total=handle.params.num_inference_steps or 0)
        self.records[rec.id] = rec
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)
        return rec

    async def track(self, handle: RequestHandle) -> AsyncIterator[Event]:
        """A request's events, keeping its record current; cancels the request if the consumer goes away."""
        rec = self.records.get(handle.request_id) or self.record(handle)
        finished = False
        try:
            async for event in handle.events():
                rec.update(event)
                finished = isinstance(event, TERMINAL)
                yield event
        finally:
            if not finished:
                # The consumer went away (client disconnect): cancel, and keep the record current until the
                # request's terminal event, which nobody else will read.
                handle.cancel()
                task = asyncio.create_task(self._settle(handle, rec))
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

    @staticmethod
    async def _settle(handle: RequestHandle, rec: Record) -> None:
        rec.update(await handle.result())


STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", Metrics)
PRELOADED = web.AppKey("preloaded_adapter", ModelAdapter)
JOIN = web.AppKey("join_group", Callable)
