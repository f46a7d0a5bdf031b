"""Per-request flow-matching sampler state.

diffusers schedulers keep `_step_index` and `sigmas` on `self`, so one shared scheduler object would corrupt a mixed
batch. Each request gets its own copy of the checkpoint's scheduler, whose `set_timesteps` runs exactly as the
pipeline runs it (same helper, same arguments), so shifts, dynamic shifting and custom sigma schedules all carry over.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps


class FlowMatchSampler:
    __slots__ = ("device_sigmas", "dts", "euler", "index", "scheduler", "sigmas", "timesteps")

    def __init__(
        self, template: Any, num_inference_steps: int, device: torch.device | str, *, start: int = 0, **kwargs: Any
    ) -> None:
        """`start`: the schedule position to begin at (img2img's `SamplingParams.first_step`)."""
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

    def noise_image(self, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Img2img's first latents: the image's latents noised to the starting sigma (the scheduler's own
        `scale_noise`, which reads the begin index as the Img2Img pipelines set it)."""
        return self.scheduler.scale_noise(image_latents, self.timesteps[self.index : self.index + 1], noise)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.index]

    @property
    def sigma(self) -> torch.Tensor:
        return self.sigmas[self.index]


def step_batch(samplers: Sequence[FlowMatchSampler], sample: torch.Tensor, model_output: torch.Tensor) -> torch.Tensor:
    """One sampler step for a batch whose rows belong to different requests at different positions.

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
        rows.append(s.scheduler.step(model_output[i : i + 1], s.timestep, sample[i : i + 1], return_dict=False)[0])
        s.index += 1
    return torch.cat(rows)
