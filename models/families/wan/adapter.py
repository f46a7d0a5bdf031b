"""Wan 2.1 and 2.2 video (`WanPipeline` text-to-video, `WanImageToVideoPipeline` image-to-video): a 3D transformer over
frames x height x width latent tokens, a UMT5 text encoder, a causal video VAE (8x spatial, 4x temporal: a clip of
1 + 4k frames has 1 + k latent frames), and the checkpoint's scheduler (UniPC in flow-prediction mode) per request.

Requests of one size and frame count share each transformer forward (CFG rows interleaved). Every block's
cross-attention key/value projections of a request's text (and image) context are computed once, when the request
is admitted, and reused at every step (models/families/wan/projections.py); `WanCrossAttnProcessor`
(models/families/wan/attention.py) reads them. Wan 2.2 A14B's two experts and TI2V-5B's per-token timesteps: see
`WanAdapter.__init__`.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.kernels.lora_rows import LoraLayers, LoraLayerSet
from diffusiond.kernels.ulysses import UlyssesGroup
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.families.wan import prompts as wan_prompts
from diffusiond.models.families.wan.attention import (
    TEXT_TOKENS,
    ProjectionPlan,
    UlyssesWanSelfAttnProcessor,
    WanCrossAttnProcessor,
    local_tokens,
    project_text,
)
from diffusiond.models.families.wan.decode import wan_pieces
from diffusiond.models.families.wan.projections import ProjectionCache, tensor_digest, weights_version
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.clips import VideoClips
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import SchedulerSampler, request_generator
from diffusiond.models.inputs import open_rgb
from diffusiond.models.lora.rows import ExpertLoraRows
from diffusiond.models.params import MAX_FRAMES, SamplingParams
from diffusiond.models.stepcache import core as stepcore
from diffusiond.models.stepcache import forwards
from diffusiond.models.stepcache.cache import StepCache

TWO_EXPERTS_NOT_YET = "not with a two-expert checkpoint (Wan 2.2 A14B) yet"


class WanAdapter(FlowMatchAdapter):
    spec = specs.WAN
    extra_denoisers = ("transformer_2",)  # Wan 2.2 A14B's low-noise expert
    default_steps = 50
    default_guidance = 5.0
    # The pipelines' defaults: 81 frames at 832x480, played at 16 frames per second (Wan 2.1's rate).
    default_num_frames: ClassVar[int] = 81
    default_fps: ClassVar[int] = 16
    TEXT_ENCODERS = ("text_encoder",)
    decodes_in_pieces = True  # a stage of a latent frame at a time (`wan_pieces`)

    def __init__(self, pipe: Any, *, source: str, lazy: Any = None) -> None:
        self.frame_step = pipe.vae_scale_factor_temporal
        # Wan 2.2 A14B: two experts. `transformer` denoises the steps whose timestep is at or above the boundary
        # (`boundary_ratio` x the scheduler's training timesteps), `transformer_2` the rest, with `guidance_scale_2`;
        # each request by its own timestep, so one step of a batch may run both, each on its own requests' rows.
        # Without a boundary the pipeline runs `transformer` only, and so does this.
        self.transformer_2 = getattr(pipe, "transformer_2", None)
        ratio = pipe.config.get("boundary_ratio")
        if ratio is not None and self.transformer_2 is None:
            raise ValueError(f"{source}: boundary_ratio {ratio} without a transformer_2 to run the low-noise steps")
        self.boundary: float | None = None
        if ratio is not None:
            self.boundary = ratio * pipe.scheduler.config.num_train_timesteps
        self.expert = 0  # the expert `_call` runs now
        # Under Ulysses with step caching, the cached forward shards the tokens itself: the blocks' hooks stand aside.
        self._presharded = False
        # Wan 2.2 TI2V-5B (`expand_timesteps`): a timestep per latent token. Text to video, and, from the same
        # checkpoint, image to video: the first latent frame is the image's, pinned (timestep 0) at every step.
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        if self.expand_timesteps:
            self.image_inputs = ("first-frame",)
            self.default_fps = 24  # TI2V-5B's clips play at 24 frames per second
        super().__init__(pipe, source=source, lazy=lazy)
        self.projections: ProjectionCache | None = ProjectionCache()
        # One projection plan per expert: each reuses projections made by its own weights.
        self.plans = [ProjectionPlan() for _ in self.experts]
        self.plan = self.plans[0]
        for expert, plan in zip(self.experts, self.plans, strict=True):
            for i, block in enumerate(expert.blocks):
                block.attn2.set_processor(WanCrossAttnProcessor(i, plan))

    def _one_expert(self, setting: str) -> None:
        """Settings not made per expert yet refuse a two-expert checkpoint (before: they would have changed the
        high-noise expert only)."""
        if len(self.experts) > 1:
            from diffusiond.models.loading.setup import SetupError

            raise SetupError(f"{setting}: {TWO_EXPERTS_NOT_YET}")

    def _experts(self) -> tuple[Any, ...]:
        return (self.transformer,) if self.boundary is None else (self.transformer, self.transformer_2)

    def _clips(self) -> VideoClips:
        # Rotary positions exist for `rope_max_seq_len` latent frames.
        latent = self.transformer.config.rope_max_seq_len // self.transformer.config.patch_size[0]
        return VideoClips(
            frame_step=self.frame_step,
            max_frames=min(MAX_FRAMES, (latent - 1) * self.frame_step + 1),
            default_num_frames=self.default_num_frames,
            default_fps=self.default_fps,
            processor=self.pipe.video_processor,
            latent_rgb=self.latent_rgb,
            requires_image=self.requires_image,
        )

    def _lora_rows(self) -> ExpertLoraRows:
        return ExpertLoraRows()

    def _step_cache(self) -> StepCache:
        return StepCache(self.family, self.cache_methods, self._call, self._cached_forward)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return WanRequests(caps, declared, two_experts=self.boundary is not None, **parts)

    def enable_lora(self, budget_bytes: int) -> Any:
        """LoRA per request; with two experts, each choice applies in the expert it names (`LoraChoice.expert`):
        every adapter is hooked in both, and each expert's calls apply its requests' choices for it."""
        registry = super().enable_lora(budget_bytes)
        layers = [self.loras.layers]
        if len(self.experts) > 1:
            layers.append(LoraLayers(self.transformer_2))
            registry.layers = LoraLayerSet(layers)
        self.loras.experts = layers
        for plan, expert_layers in zip(self.plans, layers, strict=True):
            plan.lora = expert_layers
        return registry

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        """The frames x height x width tokens are sharded across `group` from the first block on (with their rotary
        angles); self-attention all-to-alls, cross-attention needs nothing (each rank's queries attend to the whole
        text), and the last block's output is gathered for the output projection."""
        self.ranks.ulysses = group
        for expert in self.experts:
            blocks = expert.blocks
            span: dict[str, int] = {}

            def shard(module, args, blocks=blocks, span=span):
                if self._presharded:
                    return None
                x, context, timestep_proj, rotary = args  # the blocks are called positionally
                if module is blocks[0]:
                    span["start"], span["stop"] = group.split(x.shape[1])
                    x = x[:, span["start"] : span["stop"]]
                rotary, timestep_proj = local_tokens(slice(span["start"], span["stop"]), rotary, timestep_proj)
                return (x, context, timestep_proj, rotary)

            for block in blocks:
                block.attn1.set_processor(UlyssesWanSelfAttnProcessor(group))
                block.register_forward_pre_hook(shard)
            blocks[-1].register_forward_hook(
                lambda module, args, output: output if self._presharded else group.gather_seq(output, dim=1)
            )

    def enable_tp(self, mesh: Any) -> None:
        self._one_expert("--tp")
        super().enable_tp(mesh)

    def enable_shard_weights(self, mesh: Any) -> None:
        """Sharded weights exist whole only inside their block's forward: the projections are made there again (no
        reuse), and still equal."""
        super().enable_shard_weights(mesh)
        self.projections = None

    # ---- family hooks ----

    def _vae_scale_factor(self, pipe: Any) -> int:
        return pipe.vae_scale_factor_spatial

    def _default_size(self) -> tuple[int, int]:
        """The pipelines' 832x480, scaled down to fit a transformer with fewer rotary positions."""
        width, height, m = 832, 480, self._size_multiple()
        if width > self._max_side():
            width, height = self._max_side(), max(m, round(height * self._max_side() / width / m) * m)
        return width, height

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size[1]

    def _max_side(self) -> int:
        # Rotary positions exist for `rope_max_seq_len` patches per axis.
        return min(4096, self.transformer.config.rope_max_seq_len * self._size_multiple())

    def _latent_channels(self) -> int:
        return self.vae.config.z_dim

    # ---- prepare ----

    def _latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        assert p.num_frames is not None and p.height is not None and p.width is not None
        frames = (p.num_frames - 1) // self.frame_step + 1
        s = self.vae_scale_factor
        return (1, self.vae.config.z_dim, frames, p.height // s, p.width // s)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> (embeds [1, 512, D],)
        states = []
        for i, (request_id, p) in enumerate(requests):
            generator = request_generator(p)
            sampler = SchedulerSampler(self.pipe.scheduler, p.num_inference_steps, self.device, generator=generator)
            # float32 latents, as the pipeline draws and steps them (the transformer sees its own dtype).
            latents = randn_tensor(self._latent_shape(p), generator=generator, device=self.device, dtype=torch.float32)
            (embeds,) = text[p.prompt]
            rows = [text[p.negative_prompt or ""][0], embeds] if cfg[i] else [embeds]
            cond: dict[str, Any] = {"embeds": torch.cat(rows).to(self.dtype)}
            if cfg[i]:
                cond["scale"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
                if self.boundary is not None:
                    cond["scale_2"] = torch.full([1], p.guidance_scale_2, device=self.device, dtype=torch.float32)
            state = RequestState(request_id, p, latents, sampler, cond=cond)
            if self.expand_timesteps:
                self._prepare_first_frame(state)
            else:
                self._prepare_image(state, len(rows))
            # A request with LoRA projects its rows in the forward, where its adapters apply (its keys and values
            # are its own).
            state.rows = [None if p.lora else self._acquire_text(r.to(self.dtype)) for r in rows]
            if len(self.experts) > 1:  # the low-noise expert's own
                state.shared["rows_2"] = [
                    None if p.lora else self._acquire_text(r.to(self.dtype), expert=1) for r in rows
                ]
            # The state's projections go back to the cache when the state is freed, whichever way it ends.
            held = [*state.rows, *state.shared.get("rows_2", ()), state.shared.get("image_entry")]
            entries = [e for e in held if e is not None]
            if entries and self.projections is not None:
                weakref.finalize(state, _release, self.projections, entries)
            states.append(state)
        return states

    def _prepare_image(self, state: RequestState, rows: int) -> None:
        """Image-to-video: the first frame's conditioning (`WanI2VAdapter`)."""

    def _prepare_first_frame(self, state: RequestState) -> None:
        """TI2V, as the pipelines with `expand_timesteps`: the first latent frame of the model's input is the image's
        latent (its VAE mode, normalised) where a request sends one, and the timestep of its tokens 0. Requests
        without one get an all-ones mask, which changes nothing, so both kinds share forwards."""
        p, latents = state.params, state.latents
        shape = (1, 1, *latents.shape[2:])  # [1, 1, T, h, w]
        mask = torch.ones(shape, dtype=torch.float32, device=self.device)
        first = torch.zeros((1, latents.shape[1], 1, *latents.shape[3:]), dtype=torch.float32, device=self.device)
        if p.image is not None:
            self._stage("vae")
            pixels = self.pipe.video_processor.preprocess(open_rgb(p.image), height=p.height, width=p.width)
            video = pixels.unsqueeze(2).to(self.vae.device, self.vae.dtype)  # [1, 3, 1, H, W]
            first = self.vae.encode(video).latent_dist.mode().to(self.device, torch.float32)
            config = self.vae.config
            stats = (1, config.z_dim, 1, 1, 1)
            mean = torch.tensor(config.latents_mean).view(stats).to(first.device, first.dtype)
            inverse_std = 1.0 / torch.tensor(config.latents_std).view(stats).to(first.device, first.dtype)
            first = (first - mean) * inverse_std
            mask[:, :, 0] = 0
        _, ph, pw = self.transformer.config.patch_size
        state.cond["frame_mask"], state.cond["first_frame"] = mask, first
        state.cond["token_mask"] = mask[0, 0][:, ::ph, ::pw].flatten()[None]  # [1, tokens]

    def _pinned(self, latents: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """TI2V: the first frame set to the image's latent (the pipelines' blend, in float32)."""
        mask = cond["frame_mask"]
        return (1 - mask) * cond["first_frame"] + mask * latents

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """The pipeline's `encode_prompt` rows, each prompt run through UMT5 without 512 tokens of padding."""
        self._stage(*self.TEXT_ENCODERS)
        return [(row,) for row in wan_prompts.encode_prompts(self.pipe, texts, TEXT_TOKENS, self.device)]

    # ---- projection reuse ----

    def _acquire_text(self, embeds: torch.Tensor, expert: int = 0) -> Any:
        """The text row's cross-attention projections for every block of `expert`, from the cache (None: over
        budget, or reuse is off). Entries are keyed on that expert's weights."""
        if self.projections is None:
            return None
        transformer = self.experts[expert]
        embedder = transformer.condition_embedder.text_embedder
        attns = [b.attn2 for b in transformer.blocks]
        modules = [m for a in attns for m in (a.to_k, a.to_v, a.norm_k)]
        weights = [*embedder.parameters(), *(p for m in modules for p in m.parameters())]
        key = ("text", tensor_digest(embeds), weights_version(weights))

        def compute() -> tuple[torch.Tensor, ...]:
            ctx = embedder(embeds)  # [1, 512, D], as the transformer's condition embedder makes it
            return tuple(t for a in attns for t in project_text(a, ctx))

        return self.projections.acquire(key, compute)

    # ---- denoise ----

    def _batched_rows(self, states: Sequence[RequestState]) -> dict[str, Any]:
        rows = {"text_entries": [e for s in states for e in s.rows]}
        if len(self.experts) > 1:
            rows["text_entries_2"] = [e for s in states for e in s.shared["rows_2"]]
        return rows

    def expert_of(self, state: RequestState) -> int:
        """The expert that denoises `state`'s next step: 0 (`transformer`) at or above the boundary timestep, 1
        below it (the pipeline's comparison, in the timestep's dtype)."""
        if self.boundary is None:
            return 0
        return 0 if bool(state.sampler.timestep >= self.boundary) else 1

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        """Each expert's forward over its own requests' rows; the outputs in the batch's order."""
        experts = [self.expert_of(s) for s in states]
        if len(set(experts)) == 1:
            return self._denoise_with(experts[0], states)
        out: list[torch.Tensor | None] = [None] * len(states)
        for expert in (0, 1):
            mine = [i for i, e in enumerate(experts) if e == expert]
            part = self._denoise_with(expert, [states[i] for i in mine])
            for j, i in enumerate(mine):
                out[i] = part[j : j + 1]
        return torch.cat(out)  # type: ignore[arg-type]

    def _denoise_with(self, expert: int, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage(self.denoiser if expert == 0 else "transformer_2")
        self.expert = self.loras.expert = expert
        for state in states:  # a request's first step on the low-noise expert: the high-noise one's history is void
            if state.cache is not None and state.cache.denoiser != expert:
                stepcore.restart(state)
        cond = self._batched_cond(states)
        rows = cond["embeds"].shape[0] // len(states)  # 2 with CFG: (negative, positive) per request
        latents = torch.cat([s.latents for s in states])  # [B, C, T, h, w]
        if self.expand_timesteps:
            latents = self._pinned(latents, cond)
        latents = latents.to(self.dtype)
        if "condition" in cond:  # image-to-video: [B, C + 4 + C, T, h, w]
            latents = torch.cat([latents, cond["condition"].to(self.dtype)], dim=1)
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device)  # [B]
        if self.expand_timesteps:  # [B, tokens]: the first frame's tokens at 0 where it is pinned
            timestep = cond["token_mask"] * timestep[:, None]
        batched: dict[str, Any] = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),
            "timestep": timestep.repeat_interleave(rows, dim=0),
            "encoder_hidden_states": cond["embeds"],
            "text_entries": cond["text_entries_2" if expert else "text_entries"],
            **self._image_inputs(cond, rows),
        }
        out = self.ranks.rows(rows, batched, {}, states).float()  # [B, rows, C, T, h, w]
        for state in states:
            if state.cache is not None:
                state.cache.denoiser = expert
        if rows == 1:
            return out[:, 0]
        uncond, text = out[:, 0], out[:, 1]
        scale = cond["scale"] if expert == 0 else cond["scale_2"]
        return uncond + scale.view(-1, 1, 1, 1, 1) * (text - uncond)

    def _image_inputs(self, cond: dict[str, Any], rows: int) -> dict[str, Any]:
        return {}

    def _call(self, batched: dict[str, Any], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        with self._planned(batched) as inputs:
            return self.experts[self.expert](**inputs, return_dict=False)[0]

    def _cached_forward(self, method: Any, batched: dict[str, Any], shared: Any, rows: int, states: Any):
        transformer, group = self.experts[self.expert], self.ranks.ulysses
        narrows = (*forwards.lora_narrows(transformer), self.plans[self.expert])
        sigma = torch.stack([s.sampler.sigma for s in states]).to(self.device).repeat_interleave(rows)
        with self._planned(batched) as inputs:
            self._presharded = group is not None
            try:
                return forwards.wan_forward(method, transformer, inputs, sigma, rows, states, narrows, ulysses=group)
            finally:
                self._presharded = False

    @contextmanager
    def _planned(self, batched: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The transformer's inputs, with the rows' reused projections handed to the expert's plan meanwhile."""
        batched = dict(batched)
        plan = self.plans[self.expert]
        plan.text = batched.pop("text_entries")
        plan.image = batched.pop("image_entries", [])
        try:
            yield batched
        finally:
            plan.text, plan.image = [], []

    def predicted_x0(self, state: RequestState, model_output: torch.Tensor) -> torch.Tensor:
        x0 = state.sampler.predicted_x0(state.latents, model_output)
        return (self._pinned(x0, state.cond) if self.expand_timesteps else x0)[0]  # [C, T, h, w]

    def _final_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        """What the VAE decodes, in model space [B, C, T, h, w]: TI2V's given first frame pinned, as the pipelines
        end."""
        if self.expand_timesteps:
            return torch.cat([self._pinned(s.latents, s.cond) for s in states])
        return self._unpack(torch.cat([s.latents for s in states]), states[0].params)

    def decode_in_pieces(self, states: Sequence[RequestState]) -> Generator[None, None, list[np.ndarray]]:
        """A clip decodes in pieces, a stage of a latent frame each (`wan_pieces`: `decode`'s frames exactly). Under
        offloading or tiling (the VAE moved by hooks around a whole call, or decoding tiles) it decodes in one."""
        if self._stages is not None or getattr(self.vae, "_hf_hook", None) is not None or self.vae.use_tiling:
            return (yield from super().decode_in_pieces(states))
        with torch.inference_mode():
            latents = self._vae_space(self._final_latents(states))
        video = yield from wan_pieces(self.vae, latents)
        with torch.inference_mode():
            return self.postprocess(video)

    # ---- decode and previews ----

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, T, h, w] model-space latents -> the VAE's video [B, 3, F, H, W] in [-1, 1]. Single images
        [B, C, h, w] (preview map fitting) decode as one-frame clips, to [B, 3, H, W]."""
        if latents.dim() == 4:
            return self._decode(latents[:, :, None])[:, :, 0]
        return self.vae.decode(self._vae_space(latents), return_dict=False)[0]

    def _vae_space(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents [B, C, T, h, w] -> what the VAE decodes (its dtype, mean and std undone)."""
        config = self.vae.config
        latents = latents.to(self.vae.dtype)
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inverse_std + mean  # the pipeline's arithmetic, rounding included


class WanRequests(RequestRules):
    """`two_experts`: a checkpoint whose low-noise expert has a guidance of its own (`guidance_scale_2`)."""

    def __init__(self, caps: Any, declared: Any, *, two_experts: bool, **parts: Any) -> None:
        super().__init__(caps, declared, **parts)
        self.two_experts = two_experts

    def uses_cfg(self, params: SamplingParams) -> bool:
        return (params.guidance_scale or 0.0) > 1.0  # the pipeline's `do_classifier_free_guidance`

    def batch_key(self, params: SamplingParams) -> Hashable:
        return (params.width, params.height, params.num_frames, self.uses_cfg(params), self.context_size(params))

    def _guidance_2(self, params: SamplingParams, guidance: float) -> float | None:
        if not self.two_experts:
            return super()._guidance_2(params, guidance)
        return params.guidance_scale_2 if params.guidance_scale_2 is not None else guidance


def _release(cache: ProjectionCache, entries: list[Any]) -> None:
    for entry in entries:
        cache.release(entry)
