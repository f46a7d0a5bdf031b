"""The asyncio face of the engine: add a request, iterate its events, cancel it.

Steps run in one dedicated thread (`schedule() -> broadcast -> execute() -> update_from_output()`); the event loop
never runs torch. The loop talks to the step thread through a command queue (add, cancel, stop), which the thread
drains between steps, and the thread hands events back with `loop.call_soon_threadsafe`, one callback per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from diffusiond.engine.comm import Communicator, LocalComm
from diffusiond.engine.executor import FATAL, ExecResult, Executor, GroupFault
from diffusiond.engine.mailbox import Mailbox
from diffusiond.engine.observer import EngineObserver, NullObserver
from diffusiond.engine.outputs import (
    TERMINAL,
    Cancelled,
    Completed,
    Event,
    Failed,
    Latent,
    Preview,
    Progress,
    Queued,
)
from diffusiond.engine.request import RequestStatus
from diffusiond.engine.scheduler import QueueFullError, SchedRequest, Scheduler, StepResult
from diffusiond.engine.wire import (
    LoraOp,
    LoraOpKind,
    NewRequest,
    PlanKind,
    StepPlan,
    WireError,
    check_request,
    decode_plan,
    encode_plan,
)
from diffusiond.models.base import ModelAdapter
from diffusiond.models.params import ParamError, RequestLimits, SamplingParams

log = logging.getLogger(__name__)
# One line per finished request; structured fields ride in `extra={"fields": ...}` for the JSON formatter.
request_log = logging.getLogger("diffusiond.requests")

__all__ = ["Engine", "EngineDeadError", "QueueFullError", "RequestHandle"]

# Clients of requests that finished together are expected back within this long (`_gather`).
RETURN_WITHIN_S = 1.0
# How often rank 0 looks for a fault reported by another rank (it may be stuck in a collective meanwhile).
FAULT_POLL_S = 0.5
# How long stop() waits for a step thread that died stuck in a collective before leaving it behind (a daemon thread).
STUCK_JOIN_S = 2.0


class EngineDeadError(RuntimeError):
    """The step loop stopped on an engine-level error; no request can be served."""


@dataclass(frozen=True)
class _Add:
    request: SchedRequest
    submitted: float
    progress: bool
    internal: bool = False


@dataclass(frozen=True)
class _Cancel:
    request_id: str


class _Stop:
    pass


@dataclass(frozen=True)
class _Lora:
    """Register or remove a LoRA adapter (on the step thread; in a group, every rank does the same)."""

    op: LoraOp
    future: asyncio.Future


@dataclass
class _Clock:
    submitted: float
    # Send a Progress event after every step (streams that show progress); others get none, which spares the event
    # loop a wake-up per step (2% of a request's time on 2 cores); their status comes from `steps_done`.
    progress: bool = True
    admitted: float | None = None
    first_preview: float | None = None
    # The engine's own (the warm-up): no metrics, no request log line.
    internal: bool = False


class RequestHandle:
    def __init__(self, engine: Engine, request_id: str, params: SamplingParams, mailbox: Mailbox) -> None:
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self._mailbox = mailbox

    async def events(self) -> AsyncIterator[Event]:
        """Every event of this request; ends after its one terminal event."""
        while True:
            event = await self._mailbox.get()
            yield event
            if isinstance(event, TERMINAL):
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
    ) -> None:
        self._loader: Loader | None = None
        # Set on the step thread once the model is loaded (before `start()` returns).
        self.adapter: ModelAdapter = None  # type: ignore[assignment]
        self.executor: Executor | None = None
        self.comm: Communicator = comm or LocalComm()
        if isinstance(model, ModelAdapter):
            self._attach(model, comm)
        else:
            self._loader = model
        self.scheduler = Scheduler(
            max_batch=max_batch, max_running=max_running, max_waiting=max_waiting, gate=self._loras_fit
        )
        self.limits = limits
        # Seconds an idle engine waits for a burst of requests to gather (`_gather`); 0: start at once.
        self.batch_wait = batch_wait
        # Requests that completed together in the last step that completed several, and when (step thread).
        self._returning = 0
        self._returned_at = 0.0
        self._commands: queue.SimpleQueue[_Add | _Cancel | _Stop | _Lora] = queue.SimpleQueue()
        self._mailboxes: dict[str, Mailbox] = {}
        self._capacity = max_waiting + self.scheduler.max_running
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.observer: EngineObserver = observer or NullObserver()
        self.heartbeat = heartbeat
        # Set on the event loop when the step loop dies (a rank died, a bug): the process should exit and restart.
        self.fatal = asyncio.Event()
        # Step-thread only: per-request timestamps (perf_counter) for metrics and the request log line.
        self._clock: dict[str, _Clock] = {}
        self.error: BaseException | None = None
        self.steps = 0
        # Called on the event loop with every event as the engine delivers it, whether or not anyone reads the
        # request's mailbox (status records stay current for slow readers).
        self.on_event: Callable[[Event], None] | None = None
        self._counts = (-1, -1)
        self._stopping = threading.Event()
        # request id -> steps done, written by the step thread after each step, read by the loop for status
        # (plain dict operations are atomic under the GIL); an entry goes with its request's terminal event.
        self.steps_done: dict[str, int] = {}

    # ---- lifecycle ----

    async def start(self) -> None:
        """Starts the step thread, which loads the model (if given a loader) and then runs steps. Returns once the
        model is loaded; raises what loading raised."""
        self._loop = loop = asyncio.get_running_loop()
        loaded = loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(loaded,), name="diffusiond-step", daemon=True)
        self._thread.start()
        await loaded
        if self.comm.world_size > 1:
            threading.Thread(target=self._watch_faults, name="diffusiond-faults", daemon=True).start()

    def _attach(self, adapter: ModelAdapter, comm: Communicator | None) -> None:
        self.adapter = adapter
        self.comm = comm or self.comm
        self.executor = Executor(adapter, comm=self.comm, driver=True)

    def _main(self, loaded: asyncio.Future) -> None:
        loop = self._loop
        assert loop is not None
        try:
            if self._loader is not None:
                model = self._loader()
                self._attach(*(model if isinstance(model, tuple) else (model, None)))
        except BaseException as exc:
            log.exception("the model failed to load")
            self.error = exc
            loop.call_soon_threadsafe(_settle, loaded, exc)
            return
        loop.call_soon_threadsafe(_settle, loaded, None)
        self._run()

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is None:
            return
        self._commands.put(_Stop())
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

    # ---- requests (event-loop thread) ----

    def check(self, params: SamplingParams) -> SamplingParams:
        """Resolve defaults and validate against the model, the operator's limits and the wire; raises ParamError
        naming the field. What this returns can be planned, encoded and prepared on every rank."""
        resolved = self.adapter.resolve(params)
        if self.limits is not None and (over := self.limits.check(resolved)) is not None:
            raise ParamError(*over)
        try:
            check_request(NewRequest("check", resolved))
        except WireError as exc:
            raise ParamError(exc.field or "request", str(exc)) from None
        return resolved

    def add_request(
        self, params: SamplingParams, request_id: str | None = None, *, progress: bool = True, internal: bool = False
    ) -> RequestHandle:
        """Validate, resolve defaults and queue a request. Raises ParamError (bad input), QueueFullError (retry
        later) or EngineDeadError. `internal`: the engine's own (warm-up), kept out of metrics and request logs."""
        if not self.alive or self.executor is None:
            raise EngineDeadError("engine is not running")
        resolved = self.check(params)
        if len(self._mailboxes) >= self._capacity:
            raise QueueFullError(f"{len(self._mailboxes)} requests in flight (capacity {self._capacity})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._mailboxes:
            raise ValueError(f"duplicate request id {request_id!r}")
        mailbox = Mailbox()
        self._mailboxes[request_id] = mailbox
        request = SchedRequest(
            request_id=request_id,
            params=resolved,
            key=self.adapter.batch_key(resolved),
            total_steps=resolved.steps_to_run,
        )
        self._commands.put(_Add(request, time.perf_counter(), progress, internal))
        return RequestHandle(self, request_id, resolved, mailbox)

    # ---- LoRA adapters (event-loop thread; the work runs on the step thread) ----

    async def register_lora(self, name: str, path: str) -> dict:
        """Reads and registers an adapter on every rank; its listing entry. Raises LoraError (a bad file, a taken
        name; nothing changed) or EngineDeadError."""
        return await self._lora_command(LoraOp(LoraOpKind.REGISTER, name, path))

    async def unregister_lora(self, name: str) -> dict:
        """Forgets an adapter on every rank (requests in flight that use it finish with it). LoraError: unknown."""
        return await self._lora_command(LoraOp(LoraOpKind.UNREGISTER, name))

    def loras(self) -> list[dict]:
        """The registered adapters (name, path, bytes, resident), by name."""
        registry = self.adapter.lora_registry if self.adapter is not None else None
        if registry is None:
            return []
        return [entry.public() for _, entry in sorted(registry.entries.items())]

    async def _lora_command(self, op: LoraOp) -> dict:
        if not self.alive:
            raise EngineDeadError("engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Lora(op, future))
        return await future

    def _change_loras(self, command: _Lora) -> None:
        """Step thread: rank 0 changes its registry first (a bad file fails here, before any other rank reads it),
        then the others follow through a LORA plan."""
        from diffusiond.models.lora_files import LoraError

        op, loop = command.op, self._loop
        assert loop is not None
        registry = self.adapter.lora_registry
        try:
            if registry is None:
                raise LoraError("this server serves no LoRA adapters (its model's family, or its parallel layout)")
            entry = (
                registry.register(op.name, op.path) if op.kind == LoraOpKind.REGISTER else registry.unregister(op.name)
            )
        except Exception as exc:
            if not isinstance(exc, LoraError):
                log.exception("LoRA %s %s failed", op.kind.name.lower(), op.name)
                exc = LoraError(f"{op.name}: could not be loaded: {type(exc).__name__}")
            loop.call_soon_threadsafe(_settle, command.future, exc)
            return
        if self.comm.world_size > 1:
            self.comm.broadcast(encode_plan(StepPlan(step=-1, kind=PlanKind.LORA, loras=[op])))
        loop.call_soon_threadsafe(_settle, command.future, None, entry.public())

    def _loras_fit(self, request: SchedRequest, running: list[SchedRequest]) -> bool:
        """Scheduler gate: a request with adapters joins once they fit in the LoRA budget beside those in use."""
        registry = self.adapter.lora_registry
        if registry is None or not request.params.lora:
            return True
        return registry.fits(c.name for r in (*running, request) for c in (r.params.lora or ()))

    def cancel(self, request_id: str) -> None:
        """Stops the request at the next step boundary; its terminal event is Cancelled (unless it finished first)."""
        if request_id in self._mailboxes:
            self._commands.put(_Cancel(request_id))

    def _deliver(self, events: list[Event]) -> None:
        for event in events:
            if self.on_event is not None and event.request_id in self._mailboxes:
                self.on_event(event)
            mailbox = self._mailboxes.get(event.request_id)
            if mailbox is None:
                continue
            mailbox.put(event)
            if isinstance(event, TERMINAL):
                del self._mailboxes[event.request_id]
                self.steps_done.pop(event.request_id, None)

    # ---- the step thread ----

    def _emit(self, events: list[Event]) -> None:
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _drain_commands(self, events: list[Event], *, block: bool) -> bool:
        """Apply queued commands; False once asked to stop. While idle in a group, heartbeat plans keep followers
        out of collective timeouts and reveal a dead rank within a heartbeat."""
        group = self.comm.world_size > 1
        while True:
            try:
                command = self._commands.get(block=block, timeout=self.heartbeat if block and group else None)
            except queue.Empty:
                if block and group:
                    self.comm.broadcast(encode_plan(StepPlan(step=-1, kind=PlanKind.HEARTBEAT)))
                    continue
                break
            block = False
            if not self._apply(command, events):
                return False
        return self._gather(events)

    def _gather(self, events: list[Event]) -> bool:
        """The admission window: nothing runs and requests are arriving. Wait up to `batch_wait` seconds for more, so
        that a burst starts (and finishes, and decodes) as one batch instead of a request ahead of the rest.

        It closes at `max_batch` requests, or once no request arrived for a gap: short (1/40 of the window, all a
        lone request pays), or long (1/4) while the clients of requests that finished together in the last second
        are coming back. Those come back spread by their answers' encoding, and a round split by a short gap stays
        split for good (the late request finishes a step later, so it comes back later): measured on the bundled
        model, 8 closed-loop clients got 10% more images/s with the long gap."""
        if self.batch_wait <= 0 or not self.scheduler.num_waiting or self.scheduler.num_running:
            return True
        now = time.perf_counter()
        expected = self._returning if now - self._returned_at < RETURN_WITHIN_S else 0
        deadline = now + self.batch_wait
        while self.scheduler.num_waiting < self.scheduler.max_batch:
            waiting = self.scheduler.num_waiting
            if expected and waiting >= expected:
                break
            gap = self.batch_wait / (4 if waiting < expected else 40)
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                command = self._commands.get(timeout=min(gap, remaining))
            except queue.Empty:
                break
            if not self._apply(command, events):
                return False
        self._returning = 0
        return True

    def _apply(self, command: _Add | _Cancel | _Stop | _Lora, events: list[Event]) -> bool:
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            request = command.request
            self._clock[request.request_id] = _Clock(command.submitted, command.progress, internal=command.internal)
            try:
                self.scheduler.add(request)
            except QueueFullError as exc:
                events.append(Failed(request.request_id, f"queue full: {exc}"))
                self._finished(request, RequestStatus.FINISHED_FAILED)
                return True
            events.append(Queued(request.request_id, self.scheduler.num_waiting - 1))
        elif isinstance(command, _Lora):
            self._change_loras(command)
        elif isinstance(command, _Cancel):
            request = self.scheduler.cancel(command.request_id)
            if request is not None and request.status == RequestStatus.FINISHED_CANCELLED:
                events.append(Cancelled(request.request_id))
                self._finished(request, request.status)
        return True

    def _run(self) -> None:
        try:
            while True:
                events: list[Event] = []
                running = self._drain_commands(events, block=not self.scheduler.has_work())
                self._report_counts()
                if running and self.scheduler.has_work():
                    quiet = self._only_internal()  # before the step ends the warm-up's clock
                    t0 = time.perf_counter()
                    plan = decode_plan(self.comm.broadcast(encode_plan(self.scheduler.schedule())))
                    broadcast = time.perf_counter() - t0
                    self._admitted(plan, t0)
                    result = self.executor.execute(plan)
                    self.steps += 1
                    result.timings["broadcast"] = broadcast
                    events.extend(self._events_for(plan, result))
                    if not quiet:
                        self.observer.on_step(result.timings, result.batch_size, len(result.advanced))
                    self._report_counts()
                if not running:
                    # Stopped with requests in flight: each still gets its one terminal event.
                    leftovers = [*self.scheduler.waiting, *self.scheduler.running.values()]
                    self.scheduler.fail_all("engine stopped")
                    for request in leftovers:
                        events.append(Cancelled(request.request_id, "engine stopped"))
                        self._finished(request, RequestStatus.FINISHED_CANCELLED)
                    self._report_counts()
                self._emit(events)
                if not running:
                    return
        except BaseException as exc:
            reason = self._reason(exc)
            log.exception("engine step loop failed (%s); failing every request", reason)
            self.error = exc
            failed = self.scheduler.fail_all(reason)
            for request in failed:
                self._finished(request, RequestStatus.FINISHED_FAILED)
            self._emit([Failed(r.request_id, _engine_failed(r.request_id, reason)) for r in failed])
            self._report_counts()
            # Requests whose add command never reached the scheduler end too.
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_orphans, reason)
                self._loop.call_soon_threadsafe(self.fatal.set)
        finally:
            self._fail_lora_commands()
            if self.error is None or not isinstance(self.error, FATAL):
                try:
                    self.comm.broadcast(encode_plan(StepPlan(step=-1, kind=PlanKind.SHUTDOWN)))
                except Exception:
                    log.exception("could not send the shutdown plan")

    def _fail_lora_commands(self) -> None:
        """The step loop ends: LoRA changes still queued never happen; their callers hear so."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Lora) and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_settle, command.future, EngineDeadError("engine stopped"))

    def _reason(self, exc: BaseException) -> str:
        """What clients are told about an engine failure: which rank failed, never exception text."""
        if isinstance(exc, FATAL):
            reported = self.comm.fault()
            if reported:
                return reported
            return str(exc) if isinstance(exc, GroupFault) else "a rank of the serving group failed"
        return "internal error in the step loop"

    def _only_internal(self) -> bool:
        """Only the engine's own requests in flight (the warm-up, which runs before any user request)."""
        return bool(self._clock) and all(clock.internal for clock in self._clock.values())

    def _report_counts(self) -> None:
        """Gauges follow every change of the scheduler's state, not only steps (a cancel while idle is one)."""
        counts = (self.scheduler.num_waiting, self.scheduler.num_running)
        if counts != self._counts and not self._only_internal():
            self._counts = counts
            self.observer.on_counts(*counts)

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
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(self._group_failed, reason)
                return

    def _group_failed(self, reason: str) -> None:
        """Event loop: the group is gone while the step thread may still be blocked."""
        if self.error is None:
            self.error = GroupFault(reason)
        self._fail_orphans(reason)
        self.fatal.set()

    def _fail_orphans(self, reason: str) -> None:
        self._deliver([Failed(rid, _engine_failed(rid, reason)) for rid in list(self._mailboxes)])

    def _admitted(self, plan: StepPlan, now: float) -> None:
        for new in plan.new:
            clock = self._clock.get(new.request_id)
            if clock is not None:
                clock.admitted = now
                if not clock.internal:
                    self.observer.on_admitted(new.request_id, now - clock.submitted)

    def _finished(self, request: SchedRequest, status: RequestStatus) -> None:
        """Metrics and the one log line of a request that reached a terminal status."""
        clock = self._clock.pop(request.request_id, None)
        if clock is None or clock.internal:
            return
        now = time.perf_counter()
        duration = now - clock.submitted
        queue_wait = (clock.admitted if clock.admitted is not None else now) - clock.submitted
        outcome = status.name.removeprefix("FINISHED_").lower()
        self.observer.on_finished(request.request_id, outcome, duration, request.steps_done, request.total_steps)
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

    def _events_for(self, plan: StepPlan, result: ExecResult) -> list[Event]:
        finished = self.scheduler.update_from_output(plan, StepResult(result.advanced, result.failed))
        completed = sum(r.status == RequestStatus.FINISHED_COMPLETED for r in finished)
        if completed > 1:
            self._returning = min(completed, self.scheduler.max_batch)
            self._returned_at = time.perf_counter()
        finished_by_id = {r.request_id: r for r in finished}
        now = time.perf_counter()
        events: list[Event] = []
        for request_id in result.advanced:
            request = self.scheduler.get(request_id) or finished_by_id.get(request_id)
            if request is None or request.status == RequestStatus.FINISHED_FAILED:
                continue
            self.steps_done[request_id] = request.steps_done
            clock = self._clock.get(request_id)
            if clock is None or clock.progress:
                events.append(Progress(request_id, request.steps_done, request.total_steps))
        for request_id, (step, image) in result.previews.items():
            request = self.scheduler.get(request_id)
            if request is not None:
                events.append(Preview(request_id, step, request.total_steps, image))
                clock = self._clock.get(request_id)
                if clock is not None and clock.first_preview is None:
                    clock.first_preview = now
                    if not clock.internal:
                        self.observer.on_first_preview(request_id, now - clock.submitted)
        for request_id, latent in result.latents.items():
            request = self.scheduler.get(request_id)
            if request is not None:
                events.append(Latent(request_id, request.steps_done, request.total_steps, latent))
        for request in finished:
            self._finished(request, request.status)
            if request.status == RequestStatus.FINISHED_COMPLETED:
                image = result.images.get(request.request_id)
                if image is None:
                    events.append(Failed(request.request_id, "internal error: finished without an image"))
                    continue
                events.append(Completed(request.request_id, request.params.seed or 0, image, dict(result.timings)))
            elif request.status == RequestStatus.FINISHED_CANCELLED:
                events.append(Cancelled(request.request_id))
            else:
                events.append(Failed(request.request_id, request.error or "failed"))
        return events

    def cancel_all(self) -> int:
        """Cancels every request in flight (the drain deadline passed); each still gets its terminal event.
        Returns how many were in flight."""
        for request_id in list(self._mailboxes):
            self.cancel(request_id)
        return len(self._mailboxes)


def _engine_failed(request_id: str, reason: str) -> str:
    return f"the engine stopped before this request finished: {reason} (request {request_id})"


def _settle(future: asyncio.Future, error: BaseException | None, value: object = None) -> None:
    if future.done():  # its awaiter was cancelled meanwhile
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
