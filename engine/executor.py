"""Applies a `StepPlan` on one rank: free dropped states, admit and prepare new ones, one batched forward, each
request's own sampler step, previews, and decoding of the requests that finished.

A failure is pinned on the request that caused it: when a batched call raises, the executor reruns it one request at
a time, so only the culprits fail and the others go on (every rank does the same, so states stay identical).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed

from diffusiond.engine.comm import CommError
from diffusiond.engine.wire import StepPlan
from diffusiond.models.base import ModelAdapter, RequestState

T = TypeVar("T")
# A broken collective is the group's failure, not a request's: it stops the engine instead of being isolated.
FATAL = (CommError, torch.distributed.DistError)


@dataclass
class ExecResult:
    advanced: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    previews: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    images: dict[str, np.ndarray] = field(default_factory=dict)
    latents: dict[str, np.ndarray] = field(default_factory=dict)
    # stage -> seconds spent in this step: encode, denoise, sampler, preview, decode.
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Executor:
    def __init__(self, adapter: ModelAdapter, *, driver: bool = True) -> None:
        self.adapter = adapter
        # Only the driver (rank 0) needs previews and decoded images.
        self.driver = driver
        self.states: dict[str, RequestState] = {}

    def execute(self, plan: StepPlan) -> ExecResult:
        result = ExecResult()
        timings = result.timings
        if plan.drop:
            for request_id in plan.drop:
                self.states.pop(request_id, None)
            self._forget(plan.drop)

        if plan.new:
            t0 = time.perf_counter()
            _, prepared = self._isolated(self.adapter.prepare, plan.new, lambda n: n.request_id, result.failed)
            for state in prepared or ():
                self.states[state.request_id] = state
            timings["encode"] = time.perf_counter() - t0

        batch = [self.states[i] for i in plan.advance if i in self.states]
        if not batch:
            return result
        t0 = time.perf_counter()
        batch, model_output = self._isolated(self.adapter.denoise, batch, _state_id, result.failed)
        timings["denoise"] = time.perf_counter() - t0
        result.batch_size = len(batch)
        if not batch:
            return result

        if self.driver:
            t0 = time.perf_counter()
            for i, state in enumerate(batch):
                done = state.step_index + 1
                every = state.params.preview_every
                if every and done % every == 0 and done < state.total_steps:
                    x0 = self.adapter.predicted_x0(state, model_output[i : i + 1])
                    result.previews[state.request_id] = (done, self.adapter.preview(x0))
            if result.previews:
                timings["preview"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        batch, _ = self._isolated(lambda b: self._step(b, batch, model_output), batch, _state_id, result.failed)
        timings["sampler"] = time.perf_counter() - t0
        result.advanced = [s.request_id for s in batch]
        for state in batch:
            if state.request_id in result.previews and state.params.stream_latents:
                result.latents[state.request_id] = state.latents[0].to(torch.float32).cpu().numpy()

        finished = [s for s in batch if s.finished]
        if finished:
            if self.driver:
                t0 = time.perf_counter()
                done, images = self._isolated(self.adapter.decode, finished, _state_id, result.failed)
                for state, image in zip(done, images or (), strict=True):
                    result.images[state.request_id] = image
                timings["decode"] = time.perf_counter() - t0
            for state in finished:
                del self.states[state.request_id]
            self._forget([s.request_id for s in finished])
        for request_id in result.failed:
            self.states.pop(request_id, None)
        if result.failed:
            self._forget(list(result.failed))
        return result

    def _step(self, part: list[RequestState], batch: list[RequestState], model_output: torch.Tensor) -> list[None]:
        if len(part) == len(batch):
            self.adapter.step(part, model_output)
        else:
            rows = [batch.index(s) for s in part]
            self.adapter.step(part, model_output[rows])
        return [None] * len(part)

    def _forget(self, request_ids: Sequence[str]) -> None:
        forget = getattr(self.adapter, "forget", None)
        if forget is not None:
            forget(request_ids)

    def _isolated(
        self, fn: Callable[[list[T]], Any], items: Sequence[T], ident: Callable[[T], str], failed: dict[str, str]
    ) -> tuple[list[T], Any]:
        """Run `fn` on the whole batch; if it raises, run each item alone so that only the culprits fail.
        Returns the items that succeeded and `fn`'s output for them (a tensor or a list, concatenated)."""
        items = list(items)
        try:
            return items, fn(items)
        except FATAL:
            raise
        except Exception as exc:
            if len(items) == 1:
                failed[ident(items[0])] = _describe(exc)
                return [], None
        ok: list[T] = []
        outputs: list[Any] = []
        for item in items:
            try:
                outputs.append(fn([item]))
                ok.append(item)
            except FATAL:
                raise
            except Exception as exc:
                failed[ident(item)] = _describe(exc)
        if not ok:
            return [], None
        if isinstance(outputs[0], torch.Tensor):
            return ok, torch.cat(outputs)
        return ok, [x for out in outputs for x in out]


def _state_id(state: RequestState) -> str:
    return state.request_id
