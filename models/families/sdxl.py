"""Stable Diffusion XL (`StableDiffusionXLPipeline` checkpoints): a UNet with two CLIP text encoders, pooled text
and size conditioning ("time ids"), classifier-free guidance, and whatever scheduler the checkpoint names.

Requests share each UNet forward; each keeps its own copy of the scheduler and is advanced by that scheduler's own
`step` (Euler, Euler ancestral, DPM++ 2M... keep per-request state: step index, previous outputs, the request's
generator), since their updates are not one formula across a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.kernels.host import to_device
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.images import ImageStart
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import SchedulerSampler, request_generator
from diffusiond.models.params import SamplingParams
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.core import narrowed
from diffusiond.models.stepcache.forwards import lora_narrows
from diffusiond.models.stepcache.methods import Method, settle_x0, x0_computing


class SDXLAdapter(FlowMatchAdapter):
    spec = specs.SDXL
    denoiser = "unet"
    default_steps = 50
    default_guidance = 5.0
    TEXT_ENCODERS = ("text_encoder", "text_encoder_2")

    def __init__(self, pipe: Any, *, source: str, lazy: Any = None) -> None:
        if pipe.vae.dtype == torch.float16 and pipe.vae.config.force_upcast:
            # SDXL's VAE overflows in float16 (NaN images): its pipeline decodes in float32 whenever the config says
            # `force_upcast`; here it stays in float32 (a few hundred MB), the UNet in float16.
            pipe.vae.to(torch.float32)
        super().__init__(pipe, source=source, lazy=lazy)  # a second-order scheduler: models/flowmatch/sampler.py

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        # Its UNets with a guidance embedding are LCM distillations: no negative branch.
        lcm = self.transformer.config.time_cond_proj_dim is not None
        return SDXLRequests(caps, declared, lcm=lcm, **parts)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> (embeds [1, L, D], pooled [1, P])
        zeros_for_none = self.pipe.config.get("force_zeros_for_empty_prompt", False)
        states = []
        for i, (request_id, p) in enumerate(requests):
            embeds, pooled = text[p.prompt]
            generator = request_generator(p)
            sampler = SchedulerSampler(
                self.pipe.scheduler, p.num_inference_steps, self.device, start=p.start_step, generator=generator
            )
            shape = (
                1,
                self.transformer.config.in_channels,
                p.height // self.vae_scale_factor,
                p.width // self.vae_scale_factor,
            )
            inpaint = None
            if p.image is None:
                latents = randn_tensor(shape, generator=generator, device=self.device, dtype=embeds.dtype)
                latents = latents * sampler.init_noise_sigma
            else:
                latents, inpaint = self.images.noised(p, sampler, generator, self.device, embeds.dtype)
                if inpaint is not None:
                    # The Inpaint pipeline also samples the masked image's latents (which a 4-channel UNet never
                    # reads) with the request's generator: draw as much, so that schedulers drawing noise at every
                    # step (Euler ancestral) go on from the same generator state.
                    randn_tensor(latents.shape, generator=generator, device=self.device, dtype=self.vae.dtype)
            # `_get_add_time_ids`: original size, crop top-left, target size.
            time_ids = torch.tensor(
                [[p.height, p.width, 0, 0, p.height, p.width]], dtype=embeds.dtype, device=self.device
            )
            cond: dict[str, Any] = {"embeds": embeds, "pooled": pooled, "time_ids": time_ids}
            if cfg[i]:
                if p.negative_prompt is None and zeros_for_none:
                    # As `encode_prompt`: no negative prompt is zeros, not the encoding of "".
                    neg_embeds, neg_pooled = torch.zeros_like(embeds), torch.zeros_like(pooled)
                else:
                    neg_embeds, neg_pooled = text[p.negative_prompt or ""]
                # Rows (negative, positive) per request; a batch interleaves them.
                cond = {
                    "embeds": torch.cat([neg_embeds, embeds]),
                    "pooled": torch.cat([neg_pooled, pooled]),
                    "time_ids": time_ids.expand(2, -1),
                    "scale": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32),
                }
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, inpaint=inpaint))
        return states

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._stage(*self.TEXT_ENCODERS)
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return [(embeds[i : i + 1].clone(), pooled[i : i + 1].clone()) for i in range(len(texts))]

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage(self.denoiser)
        cond = self._batched_cond(states)
        rows = cond["embeds"].shape[0] // len(states)  # 2 with CFG: (negative, positive) per request
        # Each request's input scaled by its own scheduler at its own step.
        latents = torch.cat([s.sampler.scale_model_input(s.latents) for s in states])  # [B, C, h, w]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device)  # [B]
        batched = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),
            "timestep": timestep.repeat_interleave(rows),
            "encoder_hidden_states": cond["embeds"],
            "text_embeds": cond["pooled"],
            "time_ids": cond["time_ids"],
        }
        out = self.ranks.rows(rows, batched, {}, states)  # [B, rows, C, h, w]
        if rows == 1:
            return out[:, 0]
        uncond, text = out[:, 0], out[:, 1]
        return uncond + cond["scale"].to(out.dtype).view(-1, 1, 1, 1) * (text - uncond)

    def _call(self, batched: dict[str, Any], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.transformer(
            batched["hidden_states"],
            batched["timestep"],
            encoder_hidden_states=batched["encoder_hidden_states"],
            added_cond_kwargs={"text_embeds": batched["text_embeds"], "time_ids": batched["time_ids"]},
            return_dict=False,
        )[0]

    def _step_cache(self) -> StepCache:
        return StepCache(self.family, self.cache_methods, self._call, self._x0cache_forward)

    @torch.inference_mode()
    def _x0cache_forward(
        self, method: Method, batched: dict[str, Any], shared: dict[str, Any], rows: int, states: Sequence[Any]
    ) -> torch.Tensor:
        """x0cache on the UNet (models/stepcache/methods.py): a request that holds its clean image skips the whole
        UNet (its rows leave the call); its output is the one its own scheduler maps to that image at this step
        (`SchedulerSampler.output_for`: epsilon, v or flow prediction, EDM's preconditioning alike)."""
        computing = x0_computing(method, states)
        hidden = batched["hidden_states"]
        picked = [i * rows + r for i in computing for r in range(rows)]
        if len(picked) == hidden.shape[0]:
            out = self._call(batched, shared)
        else:
            out = hidden.new_zeros((hidden.shape[0], self.transformer.config.out_channels, *hidden.shape[2:]))
            if picked:
                index = to_device(picked, hidden.device)
                with narrowed(lora_narrows(self.transformer), picked):
                    out[index] = self._call({name: t[index] for name, t in batched.items()}, shared)
        mine = [slice(i * rows, (i + 1) * rows) for i in range(len(states))]
        x0 = torch.cat([s.sampler.predicted_x0(s.latents, out[m]) for s, m in zip(states, mine, strict=True)])

        def output_of(rows_of: slice, held: torch.Tensor) -> torch.Tensor:
            state = states[rows_of.start // rows]
            return state.sampler.output_for(state.latents, held)

        return settle_x0(method, out, x0, rows, states, output_of)

    def _image_start(self) -> ImageStart:
        start = super()._image_start()
        start.start = self._start_latents
        return start

    def _start_latents(self, p: SamplingParams, sampler: Any, image_latents: torch.Tensor, noise: torch.Tensor):
        if p.mask is not None and p.strength == 1.0:
            # StableDiffusionXLInpaintPipeline at full strength: pure noise at the scheduler's initial sigma.
            return noise * sampler.init_noise_sigma
        return sampler.noise_image(image_latents, noise)

    def predicted_x0(self, state: RequestState, model_output: torch.Tensor) -> torch.Tensor:
        return state.sampler.predicted_x0(state.latents, model_output)[0]

    def _statistics(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The VAE's per-channel latent mean and std, when its config has them (then they normalise latents)."""
        config = self.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return None
        shape = (1, len(mean), 1, 1)
        return torch.tensor(mean).view(shape).to(like.device, like.dtype), torch.tensor(std).view(shape).to(
            like.device, like.dtype
        )

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: with the latent statistics when the VAE has them, else its scaling factor only."""
        stats, scale = self._statistics(latents), self.vae.config.scaling_factor
        latents = latents * stats[1] / scale + stats[0] if stats is not None else latents / scale
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]

    def _encode_image(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """`_decode`'s inverse, as StableDiffusionXLImg2ImgPipeline's `prepare_latents` (the sample drawn with the
        request's generator)."""
        from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img import retrieve_latents

        latents = retrieve_latents(self.vae.encode(image.to(self.vae.dtype)), generator=generator).to(image.dtype)
        stats, scale = self._statistics(latents), self.vae.config.scaling_factor
        return (latents - stats[0]) * scale / stats[1] if stats is not None else scale * latents


class SDXLRequests(RequestRules):
    default_strength = 0.3  # StableDiffusionXLImg2ImgPipeline's
    default_inpaint_strength = 0.9999  # StableDiffusionXLInpaintPipeline's

    def __init__(self, caps: Any, declared: Any, *, lcm: bool, **parts: Any) -> None:
        super().__init__(caps, declared, **parts)
        self.lcm = lcm

    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_classifier_free_guidance`.
        return (params.guidance_scale or 0.0) > 1 and not self.lcm

    def _start_step(self, steps: int, strength: float | None) -> int:
        """StableDiffusionXLImg2ImgPipeline's `get_timesteps`: the kept steps rounded down first (50 steps at
        strength 0.56 run 28)."""
        if strength is None:
            return 0
        return max(steps - min(int(steps * strength), steps), 0)
