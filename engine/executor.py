"""Applies a `StepPlan` on one rank: free dropped states, admit and prepare new ones, one batched forward, each
request's own sampler step, previews, and decoding of the requests that finished.

Failures come in two tiers (vLLM's request errors vs engine errors):
- A stage that runs no collectives (prepare, the sampler step, previews, decode) pins a failure on the request that
  caused it: a batched call that raises is rerun one request at a time on this rank, so only the culprits fail.
  (Prompts are encoded before prepare, in a stage of their own that every rank of a group runs together:
  `_encode_together`. Prepare itself runs no collective, so a rank that fails in it alone cannot stall the others.)
  In a group the ranks must then agree, or the next forward would run different batches (and different collectives)
  per rank:
  - after prepare, every rank all-reduces one flag per new request ("this rank could not prepare it") and all drop
    the same ones. Every rank issues that collective at the same point of every plan with new requests, whatever
    happened locally, so no rank can miss it: it cannot deadlock. (One small all-reduce per admission step, not per
    step: 0.4 ms on gloo here.)
  - later stages need no collective: rank 0's failures reach the others through the next plan, which drops the
    request. A follower that failed a request alone keeps going; if the next plan still advances that request, the
    ranks have diverged and the follower raises `GroupFault` (a deterministic failure, the same on every rank, is
    dropped by that plan and never gets this far).
- The forward (`denoise`) may run collectives inside the model (CFG-parallel gathers, Ulysses all-to-alls). An error
  there leaves the other ranks inside a collective this rank will never join, so in a group it is fatal
  (`GroupFault`): every request in flight ends, the process exits and the agent restarts the group. In a world of
  one there are no collectives and the forward is isolated like the other stages.

Clients see a message with their request id; the exception and its traceback go to this rank's log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed

from diffusiond.engine.comm import Communicator, LocalComm
from diffusiond.engine.failures import FATAL, GroupFault, poisons_the_device, public_error
from diffusiond.engine.outputs import Sound
from diffusiond.engine.parking import Parking
from diffusiond.engine.timing import stage_timer
from diffusiond.engine.wire import StepPlan
from diffusiond.models.base import ModelAdapter, RequestState
from diffusiond.models.inputs import DECODED_INPUTS
from diffusiond.models.params import ParamError, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ExecResult:
    advanced: list[str] = field(default_factory=list)
    # request id -> the message its client sees (no exception text: details are in the log).
    failed: dict[str, str] = field(default_factory=dict)
    previews: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    images: dict[str, np.ndarray] = field(default_factory=dict)
    # Sound tracks of finished clips (families with audio).
    sounds: dict[str, Sound] = field(default_factory=dict)
    latents: dict[str, np.ndarray] = field(default_factory=dict)
    # stage -> seconds: encode, denoise, sampler, preview, decode (on CUDA, of stages the GPU has finished by now).
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 0
    # Requests of the forward that reused their step cache (models/stepcache/methods.py `RequestCache.reused`).
    reused: int = 0
    # Requests that finished their steps with this plan and still have pieces of their decode to run.
    decoding: list[str] = field(default_factory=list)
    # Requests whose steps turned out other than their parameters said (a generic call's, once its pipeline set its
    # timesteps), by id: the scheduler counts those.
    totals: dict[str, int] = field(default_factory=dict)


def _reused(states: Sequence[RequestState]) -> int:
    """The step cache reuses so far of these requests (counted by models/stepcache/methods.py)."""
    return sum(s.cache_reuses for s in states)


class Executor:
    def __init__(self, adapter: ModelAdapter, *, comm: Communicator | None = None, driver: bool = True) -> None:
        self.adapter = adapter
        self.comm = comm or LocalComm()
        self.rank = self.comm.rank
        self.group = self.comm.world_size > 1
        # Only the driver (rank 0) needs previews and decoded images.
        self.driver = driver
        self.states: dict[str, RequestState] = {}
        self.timer = stage_timer(adapter.capabilities.device)
        # Paused requests' states (a GPU's in host memory while they wait).
        self.parking = Parking(adapter.capabilities.device)
        # Finished requests whose decode goes on in pieces, when a plan names them (the driver's); how long the
        # last forward took (with previews and the sampler): how long a step's pieces may take.
        self.decoding: dict[str, tuple[RequestState, Generator[None, None, list[Any]]]] = {}
        self._forward_s = 0.0

    def execute(self, plan: StepPlan) -> ExecResult:
        result = ExecResult()
        self._execute(plan, result)
        if plan.decode:
            self._decode_pieces(plan.decode, result)
        result.decoding = [i for i in result.advanced if i in self.decoding]
        return self._done(result)

    def _execute(self, plan: StepPlan, result: ExecResult) -> None:
        stage = self.timer.stage
        if plan.loras:
            self._apply_loras(plan.loras)
        if plan.drop:
            for request_id in plan.drop:
                self.states.pop(request_id, None)
                self.decoding.pop(request_id, None)
            self._forget(plan.drop)
        if plan.pause or plan.resume:
            self._park(plan, result)

        if plan.new:
            new = [(n.request_id, n.params) for n in plan.new]  # the adapter takes ids and parameters
            with stage("encode"):
                if self.group:
                    self._encode_together(new, result)
                try:
                    prepared = self._isolated(self._prepare, new, _pair_id, "preparing", result)
                finally:
                    self.adapter.prepared()
            for state in prepared:
                self.states[state.request_id] = state
                if state.steps is not None:
                    result.totals[state.request_id] = state.steps

        dropped = self._agree([n.request_id for n in plan.new], result) if self.group and plan.new else set()
        batch = self._batch(plan.advance, dropped)
        if not batch:
            return
        running, reused = batch, _reused(batch)
        t0 = time.perf_counter()
        with stage("denoise"):
            batch, model_output = self._denoise(batch, result)
        result.batch_size = len(batch)
        result.reused = _reused(running) - reused
        if not batch:
            return

        if self.driver:
            due = [(i, s) for i, s in enumerate(batch) if _preview_due(s)]
            if due:
                with stage("preview"):
                    decoded = []  # "vae" previews: one batched decode for all of them (one size per batch)
                    for i, state in due:
                        try:
                            x0 = self.adapter.predicted_x0(state, model_output[i : i + 1])
                            if state.params.preview == "vae":
                                decoded.append((state, x0))
                            else:
                                image = self.adapter.preview(x0)
                                if image is not None:  # a generic pipeline's latents may be no image grid
                                    result.previews[state.request_id] = (state.step_index + 1, image)
                        except Exception as exc:
                            self._fail(state.request_id, "previewing", exc, result)
                    if decoded:
                        self._isolated(
                            lambda part: self._preview_vae(part, result), decoded, _first_id, "previewing", result
                        )
                batch, model_output = self._alive(batch, model_output)

        with stage("sampler"):
            self._isolated(lambda part: self._step(part, batch, model_output), batch, _state_id, "sampling", result)
        self._forward_s = time.perf_counter() - t0
        batch = [s for s in batch if s.request_id in self.states]
        result.advanced = [s.request_id for s in batch]
        result.totals.update({s.request_id: s.steps for s in batch if s.steps is not None})
        for state in batch:
            if state.request_id in result.previews and state.params.stream_latents:
                result.latents[state.request_id] = state.latents[0].to(torch.float32).cpu().numpy()

        finished = [s for s in batch if s.finished]
        if finished:
            shared = self.group and len(finished) >= self.comm.world_size
            # Fewer than the ranks: with patch-parallel decoding the strip group decodes each image together.
            strips = self.adapter.vae_strips if self.group and not shared else None
            if plan.decode is not None and self.adapter.decodes_in_pieces and not shared and strips is None:
                # The driver decodes alone: in pieces, as the plans say (`_decode_pieces`), from this step on.
                for state in finished:
                    self.states.pop(state.request_id, None)
                    if self.driver:
                        self.decoding[state.request_id] = (state, self.adapter.decode_in_pieces([state]))
                self._forget([s.request_id for s in finished if s.request_id not in self.decoding])
                return
            if shared or self.driver or (strips is not None and self.rank < strips.size):
                with stage("decode"):
                    if shared:
                        images = self._decode_shared(finished, result)
                    elif strips is not None and self.rank < strips.size:
                        images = self._decode_strips(finished)
                    else:
                        images = self._isolated(self._decode, finished, _state_id, "decoding", result)
                for state, image in images:
                    result.images[state.request_id] = image
                self._sounds([s for s, _ in images], result)
            for state in finished:
                self.states.pop(state.request_id, None)
            self._forget([s.request_id for s in finished])

    # ---- stages ----

    def _apply_loras(self, ops: Sequence[Any]) -> None:
        """Rank 0's registrations, done here too. One that fails here alone leaves the name unknown on this rank:
        its requests then fail to prepare here, and every rank drops them (`_agree`)."""
        from diffusiond.engine.wire import LoraOpKind

        registry = self.adapter.lora_registry
        for op in ops:
            try:
                if op.kind == LoraOpKind.REGISTER:
                    registry.register(op.name, op.path, op.sha256 or None)
                else:
                    registry.unregister(op.name)
            except Exception:
                log.exception("rank %d: LoRA %s %s failed", self.rank, op.kind.name.lower(), op.name)

    def _prepare(self, new: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        """The family's prepare, then each request's LoRA adapters (loaded now if they are not resident), held
        until its state is freed."""
        try:
            states = self.adapter.prepare(new)
        finally:
            DECODED_INPUTS.clear()
        registry = self.adapter.lora_registry
        if registry is not None:
            for state in states:
                if state.params.lora:
                    state.lora = registry.acquire(state.params.lora, state)
        return states

    def _denoise(self, batch: list[RequestState], result: ExecResult) -> tuple[list[RequestState], torch.Tensor | None]:
        try:
            return batch, self.adapter.denoise(batch)
        except FATAL:
            raise
        except Exception as exc:
            if self.group:
                ids = ", ".join(s.request_id for s in batch)
                log.error("rank %d: denoising failed for requests %s", self.rank, ids, exc_info=exc)
                raise GroupFault(f"rank {self.rank} failed while denoising") from exc
            if len(batch) == 1:
                self._fail(batch[0].request_id, "denoising", exc, result)
                return [], None
        # A world of one: no collectives ran, so each request may be retried alone.
        outputs = []
        for state in batch:
            try:
                outputs.append(self.adapter.denoise([state]))
            except FATAL:
                raise
            except Exception as exc:
                self._fail(state.request_id, "denoising", exc, result)
        ok = [s for s in batch if s.request_id in self.states]
        return ok, (torch.cat(outputs) if outputs else None)

    def _alive(self, batch: list[RequestState], model_output: torch.Tensor) -> tuple[list[RequestState], torch.Tensor]:
        """The batch without the requests that failed since the forward, and their rows of its output."""
        rows = [i for i, s in enumerate(batch) if s.request_id in self.states]
        if len(rows) == len(batch):
            return batch, model_output
        return [batch[i] for i in rows], model_output[rows]

    def _step(self, part: list[RequestState], batch: list[RequestState], model_output: torch.Tensor) -> list[None]:
        if len(part) == len(batch):
            self.adapter.step(part, model_output)
        else:
            rows = [batch.index(s) for s in part]
            self.adapter.step(part, model_output[rows])
        return [None] * len(part)

    def _decode(self, states: list[RequestState]) -> list[tuple[RequestState, np.ndarray]]:
        return list(zip(states, self.adapter.decode(states), strict=True))

    def _decode_pieces(self, request_ids: Sequence[str], result: ExecResult) -> None:
        """Pieces of the named finished requests' decodes (`ModelAdapter.decode_in_pieces`), in their order, for
        about as long as this step's forward took (the last one's when none ran), at least one; the images of
        those whose last piece ran."""
        deadline = time.perf_counter() + self._forward_s
        for request_id in request_ids:
            if (entry := self.decoding.get(request_id)) is None:
                continue  # a follower's (only the driver decodes), or dropped
            state, pieces = entry
            with self.timer.stage("decode"):
                try:
                    while True:
                        next(pieces)
                        if time.perf_counter() >= deadline:
                            return
                except StopIteration as done:
                    result.images[request_id] = done.value[0]
                except FATAL:
                    raise
                except Exception as exc:
                    self._fail(request_id, "decoding", exc, result)
            del self.decoding[request_id]
            if request_id in result.images:  # a failed one is forgotten with the others (`_done`)
                self._forget([request_id])
                self._sounds([state], result)
            if time.perf_counter() >= deadline:
                return

    def _sounds(self, states: list[RequestState], result: ExecResult) -> None:
        """The sound tracks of finished clips (families with audio), on the driver."""
        if self.driver and states and self.adapter.capabilities.audio_sample_rate:
            with self.timer.stage("decode"):
                for state, sound in self._isolated(self._decode_audio, states, _state_id, "decoding", result):
                    result.sounds[state.request_id] = sound

    def _decode_audio(self, states: list[RequestState]) -> list[tuple[RequestState, Sound]]:
        rate = self.adapter.capabilities.audio_sample_rate
        assert rate is not None
        return [(s, Sound(w, rate)) for s, w in zip(states, self.adapter.decode_audio(states), strict=True)]

    def _encode_together(self, new: Sequence[tuple[str, SamplingParams]], result: ExecResult) -> None:
        """The group's shared encoding (`ModelAdapter.encode_prompts`, collectives inside), before prepare. A failure
        of the work on rank 0 reaches every rank as the same `SharedWorkFailed`, so the one-at-a-time retries stay in
        step and only the culprits fail; any other failure here leaves the ranks out of step: fatal to the group."""
        from diffusiond.kernels.collectives import SharedWorkFailed

        def run(items: list[tuple[str, SamplingParams]]) -> list[None]:
            try:
                return self.adapter.encode_prompts([params for _, params in items])
            except (SharedWorkFailed, *FATAL):
                raise
            except Exception as exc:
                raise GroupFault(f"rank {self.rank} failed while encoding prompts") from exc

        self._isolated(run, new, _pair_id, "encoding", result)

    def _decode_strips(self, finished: list[RequestState]) -> list[tuple[RequestState, np.ndarray]]:
        """Each image decoded in strips by the strip group's ranks (kernels/patch_vae.py); its collectives make a
        failure fatal to the group. Only the driver keeps the images."""
        try:
            images = self.adapter.decode_strips(finished)
        except FATAL:
            raise
        except Exception as exc:
            log.error(
                "rank %d: strip decoding failed for %s", self.rank, [s.request_id for s in finished], exc_info=exc
            )
            raise GroupFault(f"rank {self.rank} failed while decoding") from exc
        return list(zip(finished, images, strict=True)) if self.driver else []

    def _decode_shared(self, finished: list[RequestState], result: ExecResult) -> list[tuple[RequestState, Any]]:
        """Several requests finished (every rank knows which): rank r decodes finished[r::W] and rank 0 gathers the
        VAE outputs. The gather makes a decode failure on any rank fatal to the group."""
        world = self.comm.world_size
        mine = finished[self.rank :: world]
        try:
            local = self.adapter.decode_latents(mine)  # [len(mine), 3, H, W]
        except FATAL:
            raise
        except Exception as exc:
            log.error("rank %d: decoding failed for %s", self.rank, ", ".join(s.request_id for s in mine), exc_info=exc)
            raise GroupFault(f"rank {self.rank} failed while decoding") from exc
        gathered = self.comm.gather_rows(local, [len(finished[r::world]) for r in range(world)])
        if not self.driver:
            return []
        # Rows come in rank order: rank r's j-th row is finished[r + j * world].
        order = [state for r in range(world) for state in finished[r::world]]
        rows = [(state, gathered[i : i + 1]) for i, state in enumerate(order)]

        def postprocess(items: list[tuple[RequestState, torch.Tensor]]) -> list[tuple[RequestState, np.ndarray]]:
            images = self.adapter.outputs_of([state for state, _ in items], torch.cat([row for _, row in items]))
            return [(state, image) for (state, _), image in zip(items, images, strict=True)]

        return self._isolated(postprocess, rows, lambda item: item[0].request_id, "decoding", result)

    # ---- failures ----

    def _agree(self, new: Sequence[str], result: ExecResult) -> set[str]:
        """Every rank drops the new requests that any rank could not prepare. Value per request: 0 when every rank
        prepared it, else 1 + the highest rank that could not. Returns the dropped ids."""
        mine = [0 if i in self.states else self.rank + 1 for i in new]
        dropped = set()
        for request_id, flag in zip(new, self.comm.agree(mine), strict=True):
            if flag:
                dropped.add(request_id)
                self.states.pop(request_id, None)
                if self.driver:
                    result.failed.setdefault(request_id, public_error(request_id, "preparing", flag - 1))
        return dropped

    def _batch(self, advance: Sequence[str], dropped: set[str]) -> list[RequestState]:
        batch = []
        for request_id in advance:
            state = self.states.get(request_id)
            if state is not None:
                batch.append(state)
            elif self.group and request_id not in dropped:
                # This rank failed the request alone and rank 0 still plans it: the ranks have diverged.
                raise GroupFault(f"rank {self.rank} failed a request alone (request {request_id})")
        return batch

    def _fail(self, request_id: str, stage: str, exc: BaseException, result: ExecResult) -> None:
        """A local failure: the state goes. On the driver the scheduler drops the request from the next plan on every
        rank; a follower learns from the next plan whether the failure was shared (see the module docstring). A GPU
        error that leaves the device unusable is no request's: the group's (GroupFault)."""
        if poisons_the_device(exc):
            log.error("rank %d: the GPU failed while %s request %s", self.rank, stage, request_id, exc_info=exc)
            raise GroupFault(f"rank {self.rank}: its GPU failed while {stage}; the device must be reset") from exc
        log.error("rank %d: request %s failed while %s", self.rank, request_id, stage, exc_info=exc)
        self.states.pop(request_id, None)
        if self.driver:  # a parameter the model refused only once it ran (a pipeline's own checks) says why
            result.failed[request_id] = str(exc) if isinstance(exc, ParamError) else public_error(request_id, stage)

    def _done(self, result: ExecResult) -> ExecResult:
        result.timings = self.timer.collect()
        if result.failed:
            self._forget(list(result.failed))
        return result

    def _park(self, plan: StepPlan, result: ExecResult) -> None:
        """Paused states to host memory (a GPU's), resumed ones back. A state that cannot be moved out stays where
        it is (pausing goes on); one that cannot be moved back fails its request."""
        for request_id in plan.pause:
            if (state := self.states.get(request_id)) is not None:
                try:
                    self.parking.park(state)
                except Exception:
                    log.exception("rank %d: request %s stays on the device while paused", self.rank, request_id)
        for request_id in plan.resume:
            if (state := self.states.get(request_id)) is not None:
                try:
                    self.parking.resume(state)
                except Exception as exc:
                    self._fail(request_id, "resuming", exc, result)

    def _forget(self, request_ids: Sequence[str]) -> None:
        self.parking.forget(request_ids)
        self.adapter.forget(request_ids)

    def _preview_vae(self, part: list[tuple[RequestState, torch.Tensor]], result: ExecResult) -> list[None]:
        images = self.adapter.preview_vae(torch.cat([x0[None] for _, x0 in part]))
        for (state, _), image in zip(part, images, strict=True):
            if image is not None:
                result.previews[state.request_id] = (state.step_index + 1, image)
        return [None] * len(part)

    def _isolated(
        self, fn: Callable[[list[T]], list[Any]], items: Sequence[T], ident: Callable[[T], str], stage: str, result
    ) -> list[Any]:
        """Run `fn` (no collectives inside) on the whole batch; if it raises, run each item alone so that only the
        culprits fail. `fn` returns one output per item; returns the outputs of the items that succeeded."""
        items = list(items)
        try:
            return list(fn(items))
        except FATAL:
            raise
        except Exception as exc:
            if len(items) == 1:
                self._fail(ident(items[0]), stage, exc, result)
                return []
        outputs: list[Any] = []
        for item in items:
            try:
                outputs.extend(fn([item]))
            except FATAL:
                raise
            except Exception as exc:
                self._fail(ident(item), stage, exc, result)
        return outputs


def _preview_due(state: RequestState) -> bool:
    done, every = state.step_index + 1, state.params.preview_every
    return bool(every) and done % every == 0 and done < state.total_steps


def _state_id(state: RequestState) -> str:
    return state.request_id


def _first_id(item: tuple[RequestState, Any]) -> str:
    return item[0].request_id


def _pair_id(item: tuple[str, SamplingParams]) -> str:
    return item[0]
