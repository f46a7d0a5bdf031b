"""The step thread of rank 0: the one thread that owns torch in the process. It loads the model, then runs
`schedule() -> broadcast -> execute() -> update_from_output()` for as long as there is work, applying the event
loop's commands (add, cancel, LoRA, stop) between steps and handing each step's events back to the loop in one
callback. While idle in a group, heartbeat plans keep the followers out of collective timeouts.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffusiond.engine import lora_commands
from diffusiond.engine.executor import ExecResult
from diffusiond.engine.failures import FATAL, GroupFault
from diffusiond.engine.memory import Trimmer
from diffusiond.engine.outputs import (
    Cancelled,
    Completed,
    Event,
    Failed,
    Latent,
    Paused,
    Preview,
    Progress,
    Queued,
    Resumed,
)
from diffusiond.engine.request import RequestStatus
from diffusiond.engine.scheduler import QueueFullError, SchedRequest, StepResult
from diffusiond.engine.wire import PlanKind, StepPlan, decode_plan, encode_plan
from diffusiond.models.loading.setup import SetupError
from diffusiond.models.lora.files import LoraError

if TYPE_CHECKING:
    from diffusiond.engine.engine import Engine

log = logging.getLogger(__name__)
# Loading errors that name a setting or file to fix (exit code 2, as a bad flag): LoRA files that do not fit.
CONFIG_ERRORS = (SetupError, LoraError)


class EngineDeadError(RuntimeError):
    """The step loop stopped on an engine-level error; no request can be served."""


@dataclass(frozen=True)
class Add:
    request: SchedRequest
    submitted: float
    progress: bool
    internal: bool = False


@dataclass(frozen=True)
class Cancel:
    request_id: str


class Stop:
    pass


Command = Add | Cancel | Stop | lora_commands.LoraCommand


class StepLoop:
    """What the step thread runs, over the engine's scheduler, executor and communicator."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._counts = (-1, -1)
        self.trimmer = Trimmer()

    def main(self, loaded) -> None:
        """Load the model (if the engine was given a loader), tell the event loop, then run steps."""
        engine = self.engine
        try:
            if engine.loader is not None:
                model = engine.loader()
                engine.attach(*(model if isinstance(model, tuple) else (model, None)))
        except BaseException as exc:
            if isinstance(exc, CONFIG_ERRORS):  # the operator's to fix: the message says what, no traceback needed
                log.error("the model cannot be served as configured: %s", exc)
            else:
                log.exception("the model failed to load")
            engine.error = exc
            engine.settle(loaded, exc)
            return
        engine.settle(loaded, None)
        self.run()

    def run(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        try:
            while True:
                events: list[Event] = []
                running = self._drain(events, block=not scheduler.has_work())
                self._report_counts()
                if running and scheduler.has_work():
                    self._step(events)
                if not running:
                    # Stopped with requests in flight: each still gets its one terminal event.
                    leftovers = [*scheduler.waiting, *scheduler.running.values(), *scheduler.decoding.values()]
                    scheduler.fail_all("engine stopped")
                    for request in leftovers:
                        events.append(Cancelled(request.request_id, "engine stopped"))
                        engine.clocks.finished(request, RequestStatus.FINISHED_CANCELLED)
                    self._report_counts()
                engine.emit(events)
                if not running:
                    return
        except BaseException as exc:
            reason = self._reason(exc)
            log.exception("engine step loop failed (%s); failing every request", reason)
            engine.error = exc
            failed = scheduler.fail_all(reason)
            for request in failed:
                engine.clocks.finished(request, RequestStatus.FINISHED_FAILED)
            # Never in a step (no steps_done entry): not this failure's cause, so a client may send it again.
            ids = [r.request_id for r in failed]
            engine.emit([Failed(i, engine_failed(i, reason), retry=i not in engine.steps_done) for i in ids])
            self._report_counts()
            engine.step_loop_failed(reason)  # requests whose add command never reached the scheduler end too
        finally:
            self._fail_lora_commands()
            if engine.error is None or not isinstance(engine.error, FATAL):
                try:
                    engine.comm.broadcast(encode_plan(StepPlan(step=-1, kind=PlanKind.SHUTDOWN)))
                except Exception:
                    log.exception("could not send the shutdown plan")

    def _step(self, events: list[Event]) -> None:
        """One step; its plan and outputs (a batch's decoded images) are let go when it returns, not kept by the
        loop while it waits for the next command."""
        engine = self.engine
        quiet = engine.clocks.only_internal()  # before the step ends the warm-up's clock
        t0 = time.perf_counter()
        plan = decode_plan(engine.comm.broadcast(encode_plan(engine.scheduler.schedule())))
        broadcast = time.perf_counter() - t0
        engine.clocks.admitted([new.request_id for new in plan.new], t0)
        for new in plan.new:  # in a step from now on: a failure of this step is theirs too (no retry)
            engine.steps_done.setdefault(new.request_id, 0)
        first = engine.scheduler.get(plan.advance[0]) if plan.advance else None
        result = engine.executor.execute(plan)
        engine.steps += 1
        elapsed = time.perf_counter() - t0
        stepped = first is not None and result.batch_size and not quiet
        if stepped:
            engine.step_times.record(first.key, elapsed)
        if not quiet and (costs := engine.scheduler.costs) is not None:  # None: admission in chunks turned off
            key = first.key if stepped else None
            costs.record(key, elapsed, len(plan.new), result.timings.get("encode"), len(plan.advance))
        result.timings["broadcast"] = broadcast
        events.extend(self._events_for(plan, result))
        if not quiet:
            engine.observer.on_step(result.timings, result.batch_size, len(result.advanced), result.reused)
        self._report_counts()
        self.trimmer.stepped()

    # ---- commands ----

    def _drain(self, events: list[Event], *, block: bool) -> bool:
        """Apply queued commands; False once asked to stop. While idle in a group, heartbeat plans keep followers
        out of collective timeouts and reveal a dead rank within a heartbeat; idle, freed memory goes back to the
        system once the trimmer says so (engine/memory.py)."""
        engine = self.engine
        group = engine.comm.world_size > 1
        while True:
            timeout = engine.heartbeat if group else None
            if block and (trim := self.trimmer.idle_wait()) is not None:
                timeout = trim if timeout is None else min(timeout, trim)
            try:
                command = self.commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                if not block:
                    break
                self.trimmer.idle()
                if group:  # (early, when the trim was due first: one more heartbeat costs nothing)
                    engine.comm.broadcast(encode_plan(StepPlan(step=-1, kind=PlanKind.HEARTBEAT)))
                continue
            block = False
            if not self._apply(command, events):
                return False
        return self._gather(events)

    def _gather(self, events: list[Event]) -> bool:
        """The admission window (engine/admission.py): nothing runs and requests are arriving."""
        scheduler, window = self.engine.scheduler, self.engine.window
        # Clips decoding in pieces are work in flight too: a window would hold their pieces up.
        if not window.opens(scheduler.num_waiting, scheduler.num_running + len(scheduler.decoding)):
            return True
        window.start(time.perf_counter())
        while (timeout := window.next_wait(scheduler.num_waiting, time.perf_counter())) is not None:
            try:
                command = self.commands.get(timeout=timeout)
            except queue.Empty:
                break
            if not self._apply(command, events):
                return False
        window.close()
        return True

    def _apply(self, command: Command, events: list[Event]) -> bool:
        engine = self.engine
        if isinstance(command, Stop):
            return False
        if isinstance(command, Add):
            request = command.request
            engine.clocks.submitted(
                request.request_id,
                command.submitted,
                progress=command.progress,
                internal=command.internal,
                priority=request.priority,
            )
            try:
                engine.scheduler.add(request)
            except QueueFullError as exc:
                events.append(Failed(request.request_id, f"queue full: {exc}"))
                engine.clocks.finished(request, RequestStatus.FINISHED_FAILED)
                return True
            engine.window.arrived(command.submitted)
            events.append(Queued(request.request_id, engine.scheduler.num_waiting - 1))
        elif isinstance(command, lora_commands.LoraCommand):
            lora_commands.run(command, engine.adapter, engine.comm, engine.settle)
        elif isinstance(command, Cancel):
            request = engine.scheduler.cancel(command.request_id)
            if request is not None and request.status == RequestStatus.FINISHED_CANCELLED:
                events.append(Cancelled(request.request_id))
                engine.clocks.finished(request, request.status)
        return True

    def _fail_lora_commands(self) -> None:
        """The step loop ends: LoRA changes still queued never happen; their callers hear so."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, lora_commands.LoraCommand):
                self.engine.settle(command.future, EngineDeadError("engine stopped"))

    # ---- after a step ----

    def _events_for(self, plan: StepPlan, result: ExecResult) -> list[Event]:
        engine = self.engine
        scheduler, clocks = engine.scheduler, engine.clocks
        outcome = StepResult(result.advanced, result.failed, result.decoding, list(result.images), result.totals)
        finished = scheduler.update_from_output(plan, outcome)
        done = [r for r in finished if r.status == RequestStatus.FINISHED_COMPLETED]
        step_s = engine.step_times.seconds.get(done[0].key) if done else None
        engine.window.finished_together(len(done), time.perf_counter(), step_s, scheduler.num_waiting)
        finished_by_id = {r.request_id: r for r in finished}
        now = time.perf_counter()
        events: list[Event] = self._pauses(plan)
        for request_id in result.advanced:
            request = scheduler.get(request_id) or finished_by_id.get(request_id)
            if request is None or request.status == RequestStatus.FINISHED_FAILED:
                continue
            engine.steps_done[request_id] = request.steps_done
            if clocks.wants_progress(request_id):
                events.append(Progress(request_id, request.steps_done, request.total_steps))
        for request_id, (step, image) in result.previews.items():
            request = scheduler.get(request_id)
            if request is not None:
                events.append(Preview(request_id, step, request.total_steps, image))
                clocks.previewed(request_id, now)
        for request_id, latent in result.latents.items():
            request = scheduler.get(request_id)
            if request is not None:
                events.append(Latent(request_id, request.steps_done, request.total_steps, latent))
        for request in finished:
            clocks.finished(request, request.status)
            if request.status == RequestStatus.FINISHED_COMPLETED:
                image = result.images.get(request.request_id)
                if image is None:
                    events.append(Failed(request.request_id, "internal error: finished without an image"))
                    continue
                sound = result.sounds.get(request.request_id)
                events.append(
                    Completed(request.request_id, request.params.seed or 0, image, dict(result.timings), sound)
                )
            elif request.status == RequestStatus.FINISHED_CANCELLED:
                events.append(Cancelled(request.request_id))
            else:
                events.append(Failed(request.request_id, request.error or "failed"))
        return events

    def _pauses(self, plan: StepPlan) -> list[Event]:
        """Paused and resumed events of a plan (before its progress: a resumed request's next step follows)."""
        engine = self.engine
        scheduler, observer, quiet = engine.scheduler, engine.observer, engine.clocks.only_internal()
        events: list[Event] = []
        changes = ((plan.pause, Paused, observer.on_paused), (plan.resume, Resumed, observer.on_resumed))
        for ids, kind, report in changes:
            for request_id in ids:
                if (request := scheduler.get(request_id)) is None:
                    continue
                steps = request.steps_done - (kind is Resumed and request_id in plan.advance)
                events.append(kind(request_id, max(0, steps), request.total_steps))
                if not quiet:
                    report(request_id, request.priority, scheduler.num_paused)
        return events

    def _report_counts(self) -> None:
        """Gauges follow every change of the scheduler's state, not only steps (a cancel while idle is one)."""
        engine = self.engine
        counts = (engine.scheduler.num_waiting, engine.scheduler.num_running)
        if counts != self._counts and not engine.clocks.only_internal():
            self._counts = counts
            engine.observer.on_counts(*counts)

    def _reason(self, exc: BaseException) -> str:
        """What clients are told about an engine failure: which rank failed, never exception text."""
        if isinstance(exc, FATAL):
            reported = self.engine.comm.fault()
            if reported:
                return reported
            return str(exc) if isinstance(exc, GroupFault) else "a rank of the serving group failed"
        return "internal error in the step loop"


def engine_failed(request_id: str, reason: str) -> str:
    return f"the engine stopped before this request finished: {reason} (request {request_id})"
