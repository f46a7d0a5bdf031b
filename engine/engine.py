"""The asyncio face of the engine: add a request, iterate its events, cancel it; register LoRA adapters.

Steps run in one dedicated thread (engine/step_loop.py); the event loop never runs torch. The loop talks to the
step thread through a command queue (add, cancel, LoRA, stop), which the thread drains between steps, and the thread
hands events back with `loop.call_soon_threadsafe`, one callback per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from diffusiond.engine import lora_commands
from diffusiond.engine.admission import AdmissionWindow
from diffusiond.engine.clocks import RequestClocks
from diffusiond.engine.comm import Communicator, LocalComm
from diffusiond.engine.deadlines import AdmissionCosts, StepTimes, estimate_seconds
from diffusiond.engine.executor import Executor
from diffusiond.engine.failures import GroupFault
from diffusiond.engine.mailbox import Mailbox
from diffusiond.engine.observer import EngineObserver, NullObserver
from diffusiond.engine.outputs import TERMINAL, Completed, Event, Failed
from diffusiond.engine.parking import PAUSED_BYTES
from diffusiond.engine.result_cache import ResultCache
from diffusiond.engine.scheduler import QueueFullError, SchedRequest, Scheduler
from diffusiond.engine.step_loop import Add, Cancel, EngineDeadError, StepLoop, Stop, engine_failed
from diffusiond.engine.wire import LoraOp, LoraOpKind, NewRequest, WireError, check_request
from diffusiond.models.base import ModelAdapter
from diffusiond.models.params import ParamError, RequestLimits, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineDeadError", "QueueFullError", "RequestHandle"]

# How often rank 0 looks for a fault reported by another rank (it may be stuck in a collective meanwhile).
FAULT_POLL_S = 0.5
# How long stop() waits for a step thread that died stuck in a collective before leaving it behind (a daemon thread).
STUCK_JOIN_S = 2.0
# LoRA registrations and deletions waiting for the step thread at once; more are answered 429.
MAX_LORA_COMMANDS = 16


class RequestHandle:
    def __init__(self, engine: Engine, request_id: str, params: SamplingParams, mailbox: Mailbox) -> None:
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self._mailbox = mailbox

    async def events(self) -> AsyncIterator[Event]:
        """Every event of this request; ends after its one terminal event."""
        while True:
            held = [await self._mailbox.get()]
            terminal = isinstance(held[0], TERMINAL)
            # Not kept in this frame while the consumer works: it may let a finished clip go before it is written.
            yield held.pop()
            if terminal:
                return

    async def result(self) -> Event:
        """The terminal event (Completed, Cancelled or Failed)."""
        async for event in self.events():
            if isinstance(event, TERMINAL):
                return event
        raise AssertionError("unreachable: events() ends with a terminal event")

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)


# What the step thread runs first to get its model: a loaded adapter, or an adapter and the communicator of its group.
Loader = Callable[[], "ModelAdapter | tuple[ModelAdapter, Communicator]"]


class Engine:
    """`model` is a loader, run on the step thread itself, so that one thread owns torch for the whole life of the
    process (FACTS.md: once a second thread has run torch ops, every forward of a small model runs ~2x slower). An
    adapter loaded elsewhere is accepted too (tests, tools), at that cost."""

    def __init__(
        self,
        model: ModelAdapter | Loader,
        *,
        max_batch: int = 8,
        max_running: int | None = None,
        max_waiting: int = 256,
        comm: Communicator | None = None,
        observer: EngineObserver | None = None,
        heartbeat: float = 1.0,
        limits: RequestLimits | None = None,
        batch_wait: float = 0.0,
        result_cache_bytes: int = 0,
    ) -> None:
        self.loader: Loader | None = None
        # Host memory for paused states on a GPU (engine/parking.py; `--paused-bytes`), set before start().
        self.paused_bytes = PAUSED_BYTES
        # Set on the step thread once the model is loaded (before `start()` returns).
        self.adapter: ModelAdapter = None  # type: ignore[assignment]
        self.executor: Executor | None = None
        self.comm: Communicator = comm or LocalComm()
        if isinstance(model, ModelAdapter):
            self.attach(model, comm)
        else:
            self.loader = model
        self.scheduler = Scheduler(
            max_batch=max_batch,
            max_running=max_running,
            max_waiting=max_waiting,
            gate=lambda request, running: lora_commands.fits(self.adapter, request, running),
            shares_calls=self.adapter is not None and self.adapter.shares_calls,
        )
        self.limits = limits
        # The admission window (engine/admission.py): how long an idle engine lets a burst gather.
        self.window = AdmissionWindow(batch_wait, max_batch)
        self.observer: EngineObserver = observer or NullObserver()
        # Step-thread only: per-request timestamps for metrics and the request log line.
        self.clocks = RequestClocks(self.observer)
        self.step_loop = StepLoop(self)
        self.heartbeat = heartbeat
        self._mailboxes: dict[str, Mailbox] = {}
        # Requests whose Cancel is queued for the step thread: one each, however often a client asks.
        self._cancelling: set[str] = set()
        # LoRA commands queued or running on the step thread (at most MAX_LORA_COMMANDS).
        self._lora_commands = 0
        self._capacity = max_waiting + self.scheduler.max_running
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Set on the event loop when the step loop dies (a rank died, a bug): the process should exit and restart.
        self.fatal = asyncio.Event()
        self.error: BaseException | None = None
        self.steps = 0
        # Called on the event loop with every event as the engine delivers it, whether or not anyone reads the
        # request's mailbox (status records stay current for slow readers).
        self.on_event: Callable[[Event], None] | None = None
        # Seconds per step of each batch key, as measured (deadline estimates; engine/deadlines.py).
        self.step_times = StepTimes()
        # ... and of taking new requests in: while requests run, a step admits a step's time of it at most.
        self.scheduler.costs = AdmissionCosts()
        # Loop side: what each request in flight runs (steps, class), for the estimates.
        self._work: dict[str, tuple[int, int]] = {}
        # Finished results of requests whose client chose the seed (engine/result_cache.py); None: off.
        self.result_cache = ResultCache(result_cache_bytes) if result_cache_bytes > 0 else None
        self._cache_keys: dict[str, str] = {}
        self._stopping = threading.Event()
        # request id -> steps done, written by the step thread when the request joins a step (0) and after each
        # step, read by the loop for status (plain dict operations are atomic under the GIL); an entry goes with its
        # request's terminal event. A request without one never ran a step: a group failure may `retry` it.
        self.steps_done: dict[str, int] = {}

    # ---- lifecycle ----

    async def start(self) -> None:
        """Starts the step thread, which loads the model (if given a loader) and then runs steps. Returns once the
        model is loaded; raises what loading raised."""
        self._loop = loop = asyncio.get_running_loop()
        loaded = loop.create_future()
        self._thread = threading.Thread(target=self.step_loop.main, args=(loaded,), name="diffusiond-step", daemon=True)
        self._thread.start()
        await loaded
        if self.comm.world_size > 1:
            threading.Thread(target=self._watch_faults, name="diffusiond-faults", daemon=True).start()

    def attach(self, adapter: ModelAdapter, comm: Communicator | None) -> None:
        self.adapter = adapter
        self.comm = comm or self.comm
        self.executor = Executor(adapter, comm=self.comm, driver=True)
        self.executor.parking.budget = self.paused_bytes
        if hasattr(self, "scheduler"):  # loaded on the step thread: its requests may share calls (the generic path)
            self.scheduler.shares_calls = adapter.shares_calls

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is None:
            return
        self.step_loop.commands.put(Stop())
        # A step thread of a failed group may be stuck in a collective for good; it is a daemon thread, left behind.
        await asyncio.to_thread(self._thread.join, STUCK_JOIN_S if self.error is not None else None)
        if self._thread.is_alive() and self.error is None:
            await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def has_capacity(self, n: int = 1) -> bool:
        return len(self._mailboxes) + n <= self._capacity

    @property
    def num_in_flight(self) -> int:
        return len(self._mailboxes)

    @property
    def capacity_left(self) -> int:
        return max(0, self._capacity - len(self._mailboxes))

    # ---- requests (event-loop thread) ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Defaults filled and checked against the model and the operator's limits (ParamError naming the field)."""
        resolved = self.adapter.resolve(params)
        if self.limits is not None and (over := self.limits.check(resolved)) is not None:
            raise ParamError(*over)
        return resolved

    @staticmethod
    def check_wire(params: SamplingParams) -> SamplingParams:
        """`params`, once they are known to cross the wire as they are (ParamError naming the field)."""
        try:
            check_request(NewRequest("check", params))
        except WireError as exc:
            raise ParamError(exc.field or "request", str(exc)) from None
        return params

    def check(self, params: SamplingParams) -> SamplingParams:
        """Resolve defaults and validate against the model, the operator's limits and the wire; raises ParamError
        naming the field. What this returns can be planned, encoded and prepared on every rank."""
        return self.check_wire(self.resolve(params))

    def add_request(
        self,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        checked: bool = False,
        progress: bool = True,
        internal: bool = False,
        priority: int = 0,
        tenant: str = "",
        weight: float = 1.0,
        cacheable: bool = False,
        deadline_s: float | None = None,
    ) -> RequestHandle:
        """Validate, resolve defaults and queue a request (`checked`: `params` came from `check`, or were resolved
        and wire-checked by the caller). Raises ParamError (bad input), QueueFullError (retry later) or
        EngineDeadError. `internal`: the engine's own (warm-up), kept out of metrics and request logs. `priority`,
        `tenant`, `weight`: its class and who asks, for the scheduler (engine/scheduler.py). `cacheable`: its
        client chose the seed, so an identical request's result answers it (engine/result_cache.py). `deadline_s`:
        seconds from now its client waits; earlier deadlines go first within a class (engine/scheduler.py)."""
        if not self.alive or self.executor is None:
            raise EngineDeadError("engine is not running")
        resolved = params if checked else self.check(params)
        if len(self._mailboxes) >= self._capacity:
            raise QueueFullError(f"{len(self._mailboxes)} requests in flight (capacity {self._capacity})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._mailboxes:
            raise ValueError(f"duplicate request id {request_id!r}")
        mailbox = Mailbox()
        self._mailboxes[request_id] = mailbox
        if self.result_cache is not None and cacheable and not internal:
            key = self.result_cache.key(self.adapter.source, resolved, self.adapter, tenant)
            kept = self.result_cache.get(key)
            if kept is not None:  # delivered once the caller has its handle (and has recorded it)
                asyncio.get_running_loop().call_soon(self._deliver, [self.result_cache.answer(request_id, kept)])
                return RequestHandle(self, request_id, resolved, mailbox)
            self._cache_keys[request_id] = key
        request = SchedRequest(
            request_id=request_id,
            params=resolved,
            key=self.adapter.batch_key(resolved),
            total_steps=resolved.steps_to_run,
            priority=priority,
            tenant=tenant,
            weight=weight,
            deadline=None if deadline_s is None else time.perf_counter() + deadline_s,
        )
        self._work[request_id] = (resolved.steps_to_run, priority)
        self.step_loop.commands.put(Add(request, time.perf_counter(), progress, internal))
        return RequestHandle(self, request_id, resolved, mailbox)

    def estimate(self, params: SamplingParams, priority: int) -> float | None:
        """Seconds until a request of `params` (resolved) would finish if it were queued now, from the measured
        step times and the work in flight of its class and above; None before anything was measured."""
        ahead = [total - self.steps_done.get(rid, 0) for rid, (total, p) in list(self._work.items()) if p >= priority]
        return estimate_seconds(
            self.step_times, self.adapter.batch_key(params), params.steps_to_run, ahead, self.scheduler.max_batch
        )

    def cancel(self, request_id: str) -> None:
        """Stops the request at the next step boundary; its terminal event is Cancelled (unless it finished first)."""
        if request_id in self._mailboxes and request_id not in self._cancelling:
            self._cancelling.add(request_id)
            self.step_loop.commands.put(Cancel(request_id))

    def cancel_all(self) -> int:
        """Cancels every request in flight (the drain deadline passed); each still gets its terminal event.
        Returns how many were in flight."""
        for request_id in list(self._mailboxes):
            self.cancel(request_id)
        return len(self._mailboxes)

    # ---- LoRA adapters (event-loop thread; the work runs on the step thread: engine/lora_commands.py) ----

    async def register_lora(self, name: str, path: str) -> dict:
        """Reads and registers an adapter on every rank; its listing entry. Raises LoraError (a bad file, a taken
        name; nothing changed) or EngineDeadError."""
        return await self._lora_command(LoraOp(LoraOpKind.REGISTER, name, path))

    async def unregister_lora(self, name: str) -> dict:
        """Forgets an adapter on every rank (requests in flight that use it finish with it). LoraError: unknown."""
        return await self._lora_command(LoraOp(LoraOpKind.UNREGISTER, name))

    def loras(self) -> list[dict]:
        """The registered adapters (name, path, bytes, resident), by name."""
        return lora_commands.listing(self.adapter)

    async def _lora_command(self, op: LoraOp) -> dict:
        if not self.alive:
            raise EngineDeadError("engine is not running")
        if self._lora_commands >= MAX_LORA_COMMANDS:
            raise QueueFullError(f"{self._lora_commands} LoRA registrations and deletions are waiting; retry")
        future = asyncio.get_running_loop().create_future()
        self._lora_commands += 1
        try:
            self.step_loop.commands.put(lora_commands.LoraCommand(op, future))
            return await future
        finally:
            self._lora_commands -= 1

    # ---- events, from the step thread to the loop ----

    def emit(self, events: list[Event]) -> None:
        """Step thread: hand a step's events to the event loop."""
        if events:
            self._to_loop(self._deliver, events)

    def settle(self, future: asyncio.Future, error: BaseException | None, value: object = None) -> None:
        """Step thread: answer an awaiting caller on the event loop."""
        self._to_loop(_settle, future, error, value)

    def _to_loop(self, callback: Callable[..., object], *args: object) -> bool:
        """Another thread: `callback(*args)` on the event loop; False when there is no loop to run it, or it closed
        (its owner stopped the engine and left; it may close between any check and the call)."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _deliver(self, events: list[Event]) -> None:
        """Each event to its mailbox. An observer that raises costs its own record of that event, never another
        event's delivery: a terminal event lost here would leave its client waiting and its capacity taken."""
        for event in events:
            if self.on_event is not None and event.request_id in self._mailboxes:
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("observer failed on %s of request %s", type(event).__name__, event.request_id)
            mailbox = self._mailboxes.get(event.request_id)
            if mailbox is None:
                continue
            mailbox.put(event)
            if isinstance(event, TERMINAL):
                self._work.pop(event.request_id, None)
                key = self._cache_keys.pop(event.request_id, None)
                if key is not None and isinstance(event, Completed) and self.result_cache is not None:
                    self.result_cache.put(key, event)
                del self._mailboxes[event.request_id]
                self._cancelling.discard(event.request_id)
                self.steps_done.pop(event.request_id, None)

    # ---- failures of the group ----

    def step_loop_failed(self, reason: str) -> None:
        """Step thread: the loop died; requests whose add command never reached the scheduler end too, and the
        process should exit (`fatal`)."""
        if self._to_loop(self._fail_orphans, reason):
            self._to_loop(self.fatal.set)

    def _watch_faults(self) -> None:
        """Rank 0 of a group: a fault another rank reports ends every request now, even while the step thread is
        stuck in a collective that the failed rank will never join (NCCL waits for its timeout)."""
        while not self._stopping.wait(FAULT_POLL_S):
            thread = self._thread
            if thread is None or not thread.is_alive():
                return
            reason = self.comm.fault()
            if reason is not None:
                log.error("fault reported by another rank: %s; failing every request", reason)
                self._to_loop(self._group_failed, reason)
                return

    def _group_failed(self, reason: str) -> None:
        """Event loop: the group is gone while the step thread may still be blocked."""
        if self.error is None:
            self.error = GroupFault(reason)
        self._fail_orphans(reason)
        self.fatal.set()

    def _fail_orphans(self, reason: str) -> None:
        self._deliver(
            [Failed(rid, engine_failed(rid, reason), retry=rid not in self.steps_done) for rid in list(self._mailboxes)]
        )


def _settle(future: asyncio.Future, error: BaseException | None, value: object = None) -> None:
    if future.done():  # its awaiter was cancelled meanwhile
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
