"""A pipeline's own `__call__`, run a denoising step at a time: each call runs in a greenlet on the step thread (the
one thread that owns torch) and hands control back to the step loop at every step, so that the scheduler decides
which call advances next (priorities, preemption, cancel) as it does for the dedicated families.

Where a call gives control back:
- when it is ready to denoise: just before its denoiser's first forward (a forward pre-hook on the pipeline's
  denoisers), or a Modular pipeline's first loop step; its prompts are encoded and its latents drawn by then, so
  that `prepare` is the request's encode stage;
- after every step: from its step callback (`callback_on_step_end`, or the older `callback` with
  `callback_steps=1`), or after each of a Modular pipeline's loop steps;
- when it returns: its output (after its own decode), or the exception it raised.

Calls in flight together share no per-call state: each has its own shallow copy of the pipeline (the modules shared)
with its own scheduler and guider, which diffusers keeps per call on `self` (`_step_index`, sigmas, `_guidance_scale`,
`_num_timesteps`, `_interrupt`). Thread-local state is every greenlet's on the thread: grad mode, which a pipeline's
`@torch.no_grad()` sets on entry and restores on exit, is set once around every switch into a call (`_resume`), so
that interleaved entries and exits restore what every other call runs under.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from greenlet import GreenletExit, getcurrent, greenlet

from diffusiond.models.params import ParamError

# Which call runs in each greenlet (the hooks on shared modules look their call up here).
_RUNNING: dict[Any, Call] = {}


class CallFailed(RuntimeError):
    """The pipeline's call raised; `__cause__` is what it raised."""


class CallRefused(ParamError):
    """The pipeline's call refused its arguments before its first step (a ValueError of its own checks: a Modular
    pipeline's blocks check inside the call): its message is the client's."""


def own_copy(pipe: Any) -> Any:
    """A shallow copy of `pipe` for one call: the modules shared; what a call changes on its pipeline (the scheduler,
    a guider, the attributes `__call__` sets on `self`) its own."""
    from diffusers import SchedulerMixin

    mine = copy.copy(pipe)
    for name in list(vars(pipe)):
        value = vars(pipe)[name]
        if isinstance(value, SchedulerMixin) or type(value).__module__.startswith("diffusers.guiders"):
            # Past the pipeline's __setattr__, which would write the component into the config both copies share.
            object.__setattr__(mine, name, copy.deepcopy(value))
    return mine


class Call:
    """One `__call__` of the pipeline for `rows` (request ids, one per image, in the order of the call's prompts).
    `run(callback)` calls the pipeline with the step callback it is given; `count(call)`: its steps once it is
    ready (None: counted from its callbacks)."""

    def __init__(self, rows: list[str], run: Callable[[Call], Any]) -> None:
        self.rows = list(rows)
        self.live = set(rows)
        self._run = run
        self.greenlet = greenlet(self._main)
        # "new" -> "starting" -> "ready" -> "stepping" -> "done" (or "failed")
        self.phase = "new"
        self.steps = 0  # steps it has finished
        self.total: int | None = None  # its steps, once known
        self.latents: torch.Tensor | None = None  # after its last finished step
        self.output: Any = None
        self.error: BaseException | None = None
        self.pipe: Any = None  # its own copy of the pipeline, once running

    def _main(self) -> Any:
        _RUNNING[self.greenlet] = self
        try:
            return self._run(self)
        finally:
            _RUNNING.pop(self.greenlet, None)

    @property
    def done(self) -> bool:
        return self.phase in ("done", "failed")

    def start(self) -> None:
        """Runs the call up to its first step (encoding, first latents), or to its end."""
        self.phase = "starting"
        self._resume()
        if self.phase == "starting":  # no hook gave control back before a step: the first one did
            self.phase = "stepping"

    def advance(self) -> None:
        """Runs the call's next step (or, after its last, to its end)."""
        if self.done:
            return
        self.phase = "stepping"
        self._resume()

    def finish(self) -> Any:
        """Runs the call to its end: its output (its own decode after the last step)."""
        while not self.done:
            self.advance()
        if self.error is not None:
            raise CallFailed(f"the pipeline's call failed: {self.error}") from self.error
        return self.output

    def close(self) -> None:
        """Ends a call that will not be resumed (every request of it dropped): its greenlet unwinds now, on this
        thread, running the pipeline's `finally` blocks."""
        if not self.greenlet.dead and self.greenlet:
            with torch.no_grad(), contextlib.suppress(GreenletExit):
                self.greenlet.throw(GreenletExit)
        self.phase = "failed" if self.error is not None else "done"

    def _resume(self) -> None:
        with torch.no_grad():  # every call's @torch.no_grad() then enters and leaves the same mode
            try:
                value = self.greenlet.switch()
            except Exception as exc:
                starting, self.phase, self.error = self.phase == "starting", "failed", exc
                if starting and type(exc) is ValueError:
                    raise CallRefused("request", f"the pipeline refused the request: {exc}") from exc
                raise CallFailed(f"the pipeline's call failed: {exc}") from exc
        if self.greenlet.dead:
            self.phase, self.output = "done", value

    # ---- inside the call's greenlet ----

    def ready(self, total: int | None) -> None:
        """About to run its first step: `total` steps (None: unknown yet). Gives control back."""
        if self.phase == "starting":
            self.phase = "ready"
            self.total = total
            self.greenlet.parent.switch()

    def stepped(self, latents: Any, total: int | None = None) -> None:
        """A step finished, `latents` after it. Gives control back."""
        self.steps += 1
        if total is not None:
            self.total = total
        if isinstance(latents, torch.Tensor):
            self.latents = latents
        self.greenlet.parent.switch()


def running() -> Call | None:
    """The call whose greenlet runs now (None on the step loop's own)."""
    return _RUNNING.get(getcurrent())
