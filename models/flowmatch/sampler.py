"""Per-request sampler state: `FlowMatchSampler` (flow-matching families, one batched Euler step for the whole
batch) and `SchedulerSampler` (any diffusers scheduler, each request stepped by the scheduler's own `step`).

diffusers schedulers keep `_step_index` and `sigmas` on `self`, so one shared scheduler object would corrupt a mixed
batch. Each request gets its own copy of the checkpoint's scheduler, whose `set_timesteps` runs exactly as the
pipeline runs it (same helper, same arguments), so shifts, dynamic shifting and custom sigma schedules all carry over.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps


def check_order(scheduler: Any) -> None:
    """UnsupportedLayout for a second-order scheduler (Heun, KDPM2: two forwards per step over duplicated
    timesteps): every step here is one forward, so its steps would be another schedule's (SD3 with Heun made another
    image, silently). The loader serves such a checkpoint on the generic path, the pipeline's own call."""
    from diffusiond.models.base import UnsupportedLayout

    if getattr(scheduler, "order", 1) != 1:
        raise UnsupportedLayout(
            f"{type(scheduler).__name__} is a second-order scheduler (two denoiser forwards per step), which the "
            "family does not run; pick Euler, Euler ancestral, DPM++ 2M or UniPC in scheduler_config.json"
        )


def accepted_step_kwargs(scheduler: Any, **offered: Any) -> dict[str, Any]:
    """Those of `offered` that this scheduler's `step` accepts, as the pipelines' `prepare_extra_step_kwargs` picks
    `eta` and `generator`."""
    accepts = inspect.signature(scheduler.step).parameters
    return {name: value for name, value in offered.items() if name in accepts}


class FlowMatchSampler:
    __slots__ = ("device_sigmas", "dts", "euler", "index", "scheduler", "sigmas", "step_kwargs", "timesteps")

    def __init__(
        self,
        template: Any,
        num_inference_steps: int,
        device: torch.device | str,
        *,
        start: int = 0,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        """`start`: the schedule position to begin at (img2img's `SamplingParams.start_step`). `generator`: the
        request's, from which a stochastic scheduler (`stochastic_sampling`) draws each step's fresh noise, so that
        the seed fixes the image. diffusers' pipelines do not pass their generator to `scheduler.step`; they draw
        that noise from torch's global generator, unseeded by the request."""
        self.scheduler = copy.deepcopy(template)
        self.timesteps, _ = retrieve_timesteps(self.scheduler, num_inference_steps, device, **kwargs)
        self.sigmas = self.scheduler.sigmas  # on the CPU, as diffusers keeps them
        # Per-step Euler dt and sigmas on the model's device once, so that a step copies nothing from the host (a
        # synchronous copy on CUDA). float32 on the CPU first, exactly as `scheduler.step` computes them.
        self.dts = (self.sigmas[1:] - self.sigmas[:-1]).to(device)
        self.device_sigmas = self.sigmas.to(device)
        self.scheduler.set_begin_index(start)
        # Plain Euler: the update is `x + (sigma_next - sigma) * v`, which we can apply to the whole batch at once.
        self.euler = type(self.scheduler) is FlowMatchEulerDiscreteScheduler and not getattr(
            self.scheduler.config, "stochastic_sampling", False
        )
        self.index = start
        self.step_kwargs = accepted_step_kwargs(self.scheduler, generator=generator)

    def noise_image(self, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Img2img's first latents: the image's latents noised to the starting sigma (the scheduler's own
        `scale_noise`, which reads the begin index as the Img2Img pipelines set it)."""
        return self.scheduler.scale_noise(image_latents, self.timesteps[self.index : self.index + 1], noise)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.index]

    def renoise(self, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Inpainting, after a step: the image's latents at the sigma just reached (the scheduler's `scale_noise`
        formula; after the last step sigma is 0: the image itself)."""
        sigma = self.device_sigmas[self.index].to(image_latents.dtype)
        return sigma * noise + (1.0 - sigma) * image_latents

    @property
    def sigma(self) -> torch.Tensor:
        return self.sigmas[self.index]


def step_batch(samplers: Sequence[Any], sample: torch.Tensor, model_output: torch.Tensor) -> torch.Tensor:
    """One sampler step for a batch whose rows belong to different requests at different positions
    (`FlowMatchSampler`s, or `SchedulerSampler`s: each row by its scheduler's own `step`).

    sample, model_output: [B, ...]; returns the next sample [B, ...] in `model_output`'s dtype, elementwise identical
    to each request's own `scheduler.step` (float32 upcast included).
    """
    if all(s.euler for s in samplers):
        shape = (len(samplers),) + (1,) * (sample.dim() - 1)
        dt = torch.stack([s.dts[s.index] for s in samplers]).view(shape)
        # diffusers multiplies by a 0-dim float32 dt, which computes in model_output's dtype: round dt the same way.
        dt = dt.to(device=model_output.device, dtype=model_output.dtype)
        out = (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)
        for s in samplers:
            s.index += 1
        return out
    rows = []
    for i, s in enumerate(samplers):
        row = s.scheduler.step(
            model_output[i : i + 1], s.timestep, sample[i : i + 1], **s.step_kwargs, return_dict=False
        )[0]
        rows.append(row)
        s.index += 1
    return torch.cat(rows)


class SchedulerSampler:
    """Any diffusers scheduler (Euler, Euler ancestral, DPM++ 2M, UniPC...), one copy per request, advanced by its
    own `step`: multi-step schedulers keep history on `self` (DPM++ 2M its previous outputs), and ancestral ones draw
    noise from the request's generator at every step, as the pipeline hands them its generator. A batch steps them
    through `step_batch`, row by row."""

    __slots__ = ("index", "scheduler", "step_kwargs", "timesteps")
    euler = False  # never the batched Euler update

    def __init__(
        self,
        template: Any,
        num_inference_steps: int,
        device: torch.device | str,
        *,
        start: int = 0,
        generator: torch.Generator | None = None,
        eta: float = 0.0,
    ) -> None:
        self.scheduler = copy.deepcopy(template)
        self.timesteps, _ = retrieve_timesteps(self.scheduler, num_inference_steps, device)
        if hasattr(self.scheduler, "set_begin_index"):  # as the pipelines, so step indices never search timesteps
            self.scheduler.set_begin_index(start)
        self.index = start
        self.step_kwargs = accepted_step_kwargs(self.scheduler, eta=eta, generator=generator)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.index]

    @property
    def init_noise_sigma(self) -> Any:
        return self.scheduler.init_noise_sigma

    @property
    def sigma(self) -> torch.Tensor:
        """The noise level of the step now (flow prediction: the `sigma` of `x - sigma * v`; the timestep is its
        multiple, rounded)."""
        return self.scheduler.sigmas[self.index]

    def noise_image(self, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Img2img's first latents: the image's latents noised to the starting step (the scheduler's own
        `add_noise`, which reads the begin index as the Img2Img pipelines set it)."""
        return self.scheduler.add_noise(image_latents, noise, self.timesteps[self.index : self.index + 1])

    def renoise(self, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Inpainting, after a step: the image's latents noised to the step just reached (the scheduler's own
        `add_noise`, at its step index); after the last step, the image itself."""
        if self.index >= len(self.timesteps):
            return image_latents
        return self.scheduler.add_noise(image_latents, noise, self.timesteps[self.index : self.index + 1])

    def scale_model_input(self, sample: torch.Tensor) -> torch.Tensor:
        return self.scheduler.scale_model_input(sample, self.timestep)

    def predicted_x0(self, sample: torch.Tensor, model_output: torch.Tensor) -> torch.Tensor:
        """The clean sample the model predicts now (previews), float32. Flow prediction: `x - sigma * v`.
        Karras-style schedulers (initial noise sigma
        above 1: Euler, Heun, ...) keep `x0 + sigma * noise`; the others `sqrt(a) x0 + sqrt(1 - a) noise`."""
        config = self.scheduler.config
        x, out = sample.to(torch.float32), model_output.to(torch.float32)
        precondition = getattr(self.scheduler, "precondition_outputs", None)
        if precondition is not None:  # EDM-style schedulers (cosine DPM-Solver, EDM Euler): their own estimate
            return precondition(x, out, self.scheduler.sigmas[self.index].to(x.device, torch.float32))
        if config.get("prediction_type") == "flow_prediction":  # UniPC and DPM++ on flow sigmas (Wan): x - sigma v
            sigma = self.scheduler.sigmas[self.index].to(x.device, torch.float32)
            return x - sigma * out
        if float(self.scheduler.init_noise_sigma) > 1:
            sigma = self.scheduler.sigmas[self.index].to(x.device, torch.float32)
            if config.prediction_type == "v_prediction":
                return out * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
            return x - sigma * out
        alpha = self.scheduler.alphas_cumprod[int(self.timestep)].to(x.device, torch.float32)
        if config.prediction_type == "v_prediction":
            return alpha.sqrt() * x - (1 - alpha).sqrt() * out
        return (x - (1 - alpha).sqrt() * out) / alpha.sqrt()

    def output_for(self, sample: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The model output that `predicted_x0` maps to `x0` at this step (x0cache's held clean image), float32.
        Every parametrisation above is affine in the output, x0 = a + b * out, so it inverts through itself."""
        a = self.predicted_x0(sample, torch.zeros_like(x0))
        return (x0.to(torch.float32) - a) / (self.predicted_x0(sample, torch.ones_like(x0)) - a)


def shift_mu(config: Any, image_seq_len: int, max_shift: float = 1.15) -> float:
    """The dynamic shift for `image_seq_len` tokens from a scheduler's `config`, as the pipelines compute it
    (`max_shift`: the pipeline's default when the config has none; SD3's is 1.16)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )


def packed_latent_size(params: Any, vae_scale_factor: int) -> tuple[int, int]:
    """Latent height and width of a family that packs 2x2 latent patches: even, as its pipelines' `prepare_latents`
    round them."""
    m = vae_scale_factor * 2
    return 2 * (params.height // m), 2 * (params.width // m)


def request_generator(params: Any) -> torch.Generator:
    """A request's generator: a CPU generator on every device, so that the same seed gives the same image on CPU and
    GPU, as in diffusers when it is handed a CPU generator."""
    assert params.seed is not None
    return torch.Generator(device="cpu").manual_seed(params.seed)
