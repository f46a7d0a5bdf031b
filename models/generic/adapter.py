"""The generic path: any diffusers pipeline whose call hands out its steps, served through its own call.

Each call of the pipeline runs in a greenlet on the step thread (models/generic/calls.py) and gives control back
after every step, so the engine's scheduler decides which call advances: priorities, preemption (a paused call is
not resumed), cancel and hang-up (a call none of whose requests is left is closed), deadlines, tenants, the result
cache, jobs and every stage's metric work as for the dedicated families. Requests that can share a call (equal call
arguments but prompt, negative prompt and seed) and are admitted in one step run as one call, with a list of prompts
and one generator per image: each image is the one its request gets alone. The engine advances the requests of a
call together (`shares_calls`).

Not done here, and the dedicated families' advantages: step-level batching across positions (a call's requests join
it at its start and leave it at its end), the parallel menu, per-request step caches, LoRA per request.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Hashable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from diffusiond.models.base import ModelAdapter, RequestState
from diffusiond.models.declared import check_declared, read_declared
from diffusiond.models.families.specs import GENERIC
from diffusiond.models.generic.calls import Call, own_copy, running
from diffusiond.models.generic.capabilities import capabilities_of, preview_map
from diffusiond.models.generic.outputs import output_row, to_numpy
from diffusiond.models.generic.signature import OURS, PER_PROMPT, CallSpec
from diffusiond.models.inputs import open_mask, open_rgb
from diffusiond.models.params import MAX_GUIDANCE, MAX_SEED, ParamError, SamplingParams, check_prompts

log = logging.getLogger(__name__)

# Components that denoise at every step: the first forward of one of them in a call is its first step.
DENOISER_PREFIXES = ("transformer", "unet", "prior", "controlnet", "denoiser")


class CallRow:
    """A request's place in a call: the call and its row (its prompt's index)."""

    __slots__ = ("call", "row")

    def __init__(self, call: Call, row: int) -> None:
        self.call, self.row = call, row


class GenericAdapter(ModelAdapter):
    spec = GENERIC

    def __init__(self, pipe: Any, *, source: str, call: CallSpec) -> None:
        self.pipe, self.source, self.call = pipe, source, call
        # Requests admitted together share a call (a classic pipeline's call takes lists of prompts; a Modular
        # pipeline's blocks one prompt per call).
        self.shares_calls = not call.modular
        self.pipeline_class = call.pipeline_class  # the checkpoint's, not the generic spec's
        module = next((m for m in self._modules().values()), None)
        self.device = module.device if module is not None else torch.device("cpu")
        self.dtype = module.dtype if module is not None else torch.float32
        self.declared = read_declared(source)
        self.latent_rgb = preview_map(pipe, source, self.device)
        self.capabilities = capabilities_of(pipe, call, self.declared, dtype=self.dtype, device=self.device)
        # request id -> its place in a call (while its call runs).
        self.rows: dict[str, CallRow] = {}
        if not call.modular:
            for name, m in self._modules().items():
                if name.startswith(DENOISER_PREFIXES):
                    m.register_forward_pre_hook(_first_forward)

    @classmethod
    def from_pretrained(
        cls, path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, lazy_denoiser: bool = False
    ) -> GenericAdapter:
        from diffusiond.models.generic.loading import load_generic

        return load_generic(cls, path, device=device, dtype=dtype)

    @classmethod
    def of_pipeline(cls, pipe: Any, source: str, reason: str | None = None) -> GenericAdapter:
        """A classic pipeline loaded for a dedicated family that does not read its layout (`reason`)."""
        from diffusiond.models.generic.loading import spec_of

        adapter = cls(pipe, source=source, call=spec_of(type(pipe).__name__))
        adapter.reason = reason
        return adapter

    # Why a checkpoint of a dedicated family's class is served here (None: none has one).
    reason: str | None = None

    def _modules(self) -> dict[str, torch.nn.Module]:
        components = self.pipe.components
        return {name: m for name, m in components.items() if isinstance(m, torch.nn.Module)}

    # ---- what it serves ----

    # ---- requests ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        call = self.call
        check_prompts(params)
        check_declared(self.declared, params)
        given = {name: value for name, value in msgspec.structs.asdict(params).items() if value is not None}
        for name, value in given.items():
            if name in OURS or name in ("prompt", "arguments", "images", "start_step"):
                continue
            if name == "lora":
                if not value:  # `[]` is no LoRA
                    continue
                raise ParamError("lora", f"the generic path ({self.pipeline_class}) serves no LoRA adapters")
            if name == "fps" and call.modality == "video":  # the file's rate, where the call takes none
                continue
            if call.argument_of(name) is None:
                raise ParamError(name, f"{self.pipeline_class}'s call takes no {name}; it takes: {_listed(call)}")
        for name, value in (params.arguments or {}).items():
            if not call.may_set(name):
                raise ParamError("arguments", f"{self.pipeline_class}'s call takes no argument {name!r} from a request")
            _check_argument(name, value)
        for name in params.images or {}:
            if not call.may_set(name):
                raise ParamError("images", f"{self.pipeline_class}'s call takes no image {name!r}")
        steps = params.num_inference_steps or self.capabilities.default_steps
        seed = params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") & (2**53 - 1)
        elif not 0 <= seed <= MAX_SEED:
            raise ParamError("seed", f"seed must be between 0 and {MAX_SEED}, got {seed}")
        for name in ("guidance_scale", "true_cfg_scale"):
            value = getattr(params, name)
            if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_GUIDANCE):
                raise ParamError(name, f"{name} must be between 0 and {MAX_GUIDANCE:g}, got {value}")
        # No step cache here: every quality preset is the exact image.
        quality = None if params.quality is None else "lossless"
        resolved = msgspec.structs.replace(params, seed=seed, num_inference_steps=steps, start_step=0, quality=quality)
        caps = self.capabilities
        from_image = params.image is not None and call.default("width") is None  # its call sizes it as the image
        if (
            call.takes("width")
            and call.takes("height")
            and caps.default_width
            and caps.default_height
            and not from_image
        ):
            # The pipeline's own default where the request sends none (its call would compute the same).
            resolved = msgspec.structs.replace(
                resolved, width=params.width or caps.default_width, height=params.height or caps.default_height
            )
        if call.modality == "video":
            frames = params.num_frames or self.capabilities.default_num_frames
            resolved = msgspec.structs.replace(
                resolved, num_frames=frames, fps=params.fps or self.capabilities.default_fps
            )
        if call.modular:  # its blocks check inside the call; a classic pipeline's check_inputs below
            for name in ("width", "height"):
                value = getattr(resolved, name)
                if value is not None and value % caps.size_multiple:
                    raise ParamError(name, f"{name} must be a multiple of {caps.size_multiple}; got {value}")
        self._check_inputs(resolved)
        return resolved

    def _check_inputs(self, params: SamplingParams) -> None:
        """The pipeline's own `check_inputs` (pure Python: sizes, types), so that what it would refuse inside its
        call is a 400 naming the field."""
        check = getattr(self.pipe, "check_inputs", None)
        if check is None or self.call.modular:
            return
        import inspect

        from PIL import Image

        wanted = inspect.signature(check).parameters
        kwargs = self._arguments(params)
        # Images stand in as a placeholder of their type: our own checks read the files (decodable, within limits).
        kwargs = {k: Image.new("RGB", (8, 8)) if isinstance(v, bytes) else v for k, v in kwargs.items()}
        kwargs.update(prompt=params.prompt, negative_prompt=params.negative_prompt)
        args = {
            name: kwargs.get(name) for name in wanted if name in kwargs or wanted[name].default is wanted[name].empty
        }
        if "callback_steps" in wanted and self.call.steps == "callback":
            args["callback_steps"] = 1
        try:
            check(**args)
        except TypeError:  # an argument it needs that only the call computes: its call checks it
            return
        except ValueError as exc:
            message = str(exc)
            field = next(
                (f for f in ("height", "width", "num_frames", "strength", "prompt") if f in message), "request"
            )
            raise ParamError(field, f"{self.pipeline_class}: {message}") from None

    def batch_key(self, params: SamplingParams) -> Hashable:
        """Everything the call gets but the prompts and the seed: requests with equal keys may share a call."""
        arguments = self._arguments(params)
        key = [(name, _hashable(value)) for name, value in sorted(arguments.items())]
        return ("generic", params.negative_prompt is not None, tuple(key))

    def _arguments(self, params: SamplingParams) -> dict[str, Any]:
        """The call's keyword arguments from `params`, but prompts, generator and output (images still bytes)."""
        call = self.call
        out: dict[str, Any] = {}
        for name, value in msgspec.structs.asdict(params).items():
            if (
                value is None
                or name in OURS
                or name in ("prompt", "negative_prompt", "arguments", "images", "start_step")
            ):
                continue
            argument = call.argument_of(name)
            if argument is not None:
                out[argument] = list(value) if name == "skip_guidance_layers" else value
        out.update(params.arguments or {})
        out.update(params.images or {})
        for name in PER_PROMPT:
            if call.takes(name):
                out[name] = 1
        return out

    # ---- the step ----

    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        groups: dict[Hashable, list[tuple[str, SamplingParams]]] = {}
        for request_id, params in requests:
            # A Modular pipeline's blocks encode one prompt per call: each request its own call.
            key = request_id if self.call.modular else self.batch_key(params)
            groups.setdefault(key, []).append((request_id, params))
        states = []
        for members in groups.values():
            call = Call([i for i, _ in members], self._runner([p for _, p in members]))
            call.start()
            for row, (request_id, params) in enumerate(members):
                self.rows[request_id] = CallRow(call, row)
                state = RequestState(request_id, params, _row(call.latents, row), CallRow(call, row))
                state.steps = call.total
                states.append(state)
        return states

    def _runner(self, members: list[SamplingParams]) -> Any:
        """What runs the pipeline's call for `members` (one image each), handed its `Call`."""
        first = members[0]
        kwargs = self._arguments(first)
        for name, value in list(kwargs.items()):
            if isinstance(value, bytes):
                kwargs[name] = open_mask(value) if name in ("mask_image", "control_mask") else open_rgb(value)
        kwargs["prompt"] = [p.prompt for p in members]
        if first.negative_prompt is not None:
            kwargs["negative_prompt"] = [p.negative_prompt for p in members]
        kwargs["generator"] = [torch.Generator(device="cpu").manual_seed(p.seed) for p in members]
        if self.call.modular:  # one request a call (`prepare`): its prompt and generator as they are
            kwargs.update(
                {name: kwargs[name][0] for name in ("prompt", "negative_prompt", "generator") if name in kwargs}
            )
        if self.call.takes("output_type"):
            kwargs["output_type"] = "np"
        pipe, spec = self.pipe, self.call

        settings = {name: kwargs.pop(name) for name in spec.guider if name in kwargs}

        def run(call: Call) -> Any:
            mine = own_copy(pipe)
            call.pipe = mine
            for name, value in settings.items():  # on this call's own guider (own_copy's)
                setattr(mine.guider, name, value)
            if spec.modular:
                return mine(**kwargs)
            if spec.steps == "callback_on_step_end":
                return mine(**kwargs, callback_on_step_end=_on_step_end)
            return mine(**kwargs, callback=_on_callback, callback_steps=1)

        return run

    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        """Each call of the states advances one step (a call advanced already in this step, for a retry of one of its
        requests alone, is not advanced again)."""
        for state in states:
            call = state.sampler.call
            if call.steps <= state.step_index and not call.done:
                call.advance()
                if call.error is not None:
                    raise RuntimeError(f"the pipeline's call failed: {call.error}") from call.error
            if call.done and call.total is None:
                call.total = call.steps
        for state in states:
            state.steps = state.sampler.call.total
        return torch.zeros(len(states), 1)

    def step(self, states: Sequence[RequestState], model_output: torch.Tensor) -> None:
        for state in states:
            state.step_index += 1
            state.latents = _row(state.sampler.call.latents, state.sampler.row)

    def predicted_x0(self, state: RequestState, model_output: torch.Tensor) -> torch.Tensor:
        """The request's latents after this step, as the call's callback handed them out (not a clean estimate)."""
        latents = state.sampler.call.latents
        if latents is None:
            return torch.zeros(0)
        return latents[state.sampler.row].detach()

    def preview(self, x0: torch.Tensor) -> np.ndarray | None:
        """The fast latent -> RGB map, where the latents are a 2-D (or video's 3-D) grid of the VAE's channels."""
        rgb = self.latent_rgb
        if rgb is None or x0.dim() not in (3, 4) or x0.shape[0] != rgb.channels:
            return None
        if x0.dim() == 4:  # [C, T, h, w]: the latent frames side by side
            frames = rgb.to_uint8_batch(x0.transpose(0, 1).float())
            return torch.cat(list(frames), dim=1).cpu().numpy()
        return rgb.to_uint8(x0.float())

    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray | None]:
        """The latents decoded by the pipeline's VAE (2-D latents of an AutoencoderKL: its scaling and shift)."""
        vae = getattr(self.pipe, "vae", None)
        if vae is None or x0.dim() != 4 or not hasattr(vae.config, "scaling_factor"):
            return [self.preview(x) for x in x0]
        with torch.no_grad():
            shift = getattr(vae.config, "shift_factor", None) or 0.0
            z = x0.to(vae.dtype) / vae.config.scaling_factor + shift
            images = vae.decode(z, return_dict=False)[0]
            out = (images.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return [(image * 255).round().astype(np.uint8) for image in out]

    def decode(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """Each call runs to its end (its own decode); each request its row of what the call returns."""
        outputs = []
        for state in states:
            output = state.sampler.call.finish()
            outputs.append(output_row(output, self.call.outputs, state.sampler.row, self.call.modality))
        return outputs

    def decode_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        raise NotImplementedError("the generic path decodes through the pipeline's call")

    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        raise NotImplementedError("the generic path decodes through the pipeline's call")

    def decode_audio(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """A clip's sound track, where the call returns one beside its frames."""
        waves = []
        for state in states:
            output = state.sampler.call.finish()
            audio = getattr(output, "audio", None)
            if audio is None:
                audio = getattr(output, "audios", None)
            wave = np.asarray(to_numpy(audio[state.sampler.row]), dtype=np.float32)
            waves.append(wave[None] if wave.ndim == 1 else wave)
        return waves

    def forget(self, request_ids: Sequence[str]) -> None:
        """A call none of whose requests is left ends now (its greenlet unwinds)."""
        for request_id in request_ids:
            place = self.rows.pop(request_id, None)
            if place is None:
                continue
            call = place.call
            call.live.discard(request_id)
            if not call.live and not call.done:
                call.close()


def _first_forward(module: Any, args: Any) -> None:
    """A denoiser's forward pre-hook: a call about to run its first step gives control back (its `prepare` is
    done)."""
    call = running()
    if call is not None and call.phase == "starting":
        call.ready(_planned_steps(call))


def _planned_steps(call: Call) -> int | None:
    """The steps a call about to start its loop will run: its `_num_timesteps` where the pipeline set it, else its
    scheduler's timesteps from their begin index."""
    pipe = call.pipe
    total = getattr(pipe, "_num_timesteps", None)
    if isinstance(total, int):
        return total
    scheduler = getattr(pipe, "scheduler", None)
    timesteps = getattr(scheduler, "timesteps", None)
    if timesteps is None:
        return None
    begin = getattr(scheduler, "_begin_index", None) or 0
    return len(timesteps) - begin


def _on_step_end(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    call = running()
    if call is not None:
        call.stepped(tensors.get("latents"), getattr(pipe, "_num_timesteps", None))
    return tensors


def _on_callback(i: int, t: Any, latents: Any) -> None:
    call = running()
    if call is not None:
        call.stepped(latents)


def _row(latents: Any, row: int) -> torch.Tensor:
    if isinstance(latents, torch.Tensor) and latents.dim() > 0 and latents.shape[0] > row:
        return latents[row : row + 1]
    return torch.zeros(1, 0)


def _hashable(value: Any) -> Hashable:
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _check_argument(name: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ParamError("arguments", f"argument {name!r} must be a finite number")


def _listed(call: CallSpec) -> str:
    return ", ".join(call.settable()) or "nothing but the prompt"
