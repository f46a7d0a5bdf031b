"""Stable Audio Open (`StableAudioPipeline` checkpoints): sound alone. A T5 text encoder and a projection model that
also embeds the clip's start and end seconds; a DiT over the latent frames of the longest clip the checkpoint makes
(every request, whatever its length, denoises that many frames, so any two requests share a forward), with the
seconds' embeddings as its global condition and after the text in its cross-attention; an Oobleck VAE decodes the
waveform, which is then cut to [start, end) seconds.

Its scheduler is the cosine DPM-Solver (an SDE solver): each request keeps its own copy, stepped by the scheduler's
own `step` with the request's generator, whose seed starts its Brownian tree, as the pipeline hands it its generator.
Classifier-free guidance whenever `guidance_scale` > 1; without a negative prompt the negative branch is zeros (text
and seconds alike), as the call's.

An answer is a waveform [channels, samples] (`Completed.image`, and its track at the VAE's sample rate); previews are
pictures: the latent's channels over time (fast), or the decoded waveform's envelope (`preview: "vae"`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.models.base import Capabilities, RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import SchedulerSampler, request_generator
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.forwards import lora_narrows
from diffusiond.models.stepcache.methods import Batch, Method, cached_blocks

# Preview pictures: the waveform's envelope this many pixels wide, each channel this many tall.
WAVE_WIDTH, WAVE_HEIGHT = 256, 48


class StableAudioAdapter(FlowMatchAdapter):
    spec = specs.STABLE_AUDIO
    # The pipeline's own defaults.
    default_steps = 100
    default_guidance = 7.0
    # What a group's other ranks free once rank 0 encodes for them: not the projection model, which every rank runs
    # for the seconds (`_seconds`).
    TEXT_ENCODERS = ("text_encoder",)

    def __init__(self, pipe: Any, *, source: str, lazy: Any = None) -> None:
        super().__init__(pipe, source=source, lazy=lazy)
        config = self.transformer.config
        # The pipeline's `rotary_embed_dim`, over the latent frames and the one global token.
        dim = pipe.rotary_embed_dim
        self.rotary = tuple(
            t.to(self.device) for t in get_1d_rotary_pos_embed(
                dim, config.sample_size + 1, use_real=True, repeat_interleave_real=False
            )
        )  # fmt: skip

    # ---- the parts ----

    def _step_cache(self) -> StepCache:
        cached = partial(stable_audio_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        projection = self.pipe.projection_model.config
        return AudioRequests(
            caps, declared, longest=self.longest_seconds, bounds=(projection.min_value, projection.max_value), **parts
        )

    @property
    def sample_rate(self) -> int:
        return int(self.vae.config.sampling_rate)

    @property
    def longest_seconds(self) -> float:
        """The longest clip the checkpoint makes: its latent frames times the VAE's samples per frame (the call's)."""
        return self.transformer.config.sample_size * self.vae.hop_length / self.vae.config.sampling_rate

    def _vae_scale_factor(self, pipe: Any) -> int:
        return int(pipe.vae.hop_length)  # samples per latent frame

    def _default_size(self) -> tuple[int, int]:
        return 0, 0  # no size: a clip's length is its seconds

    def _size_multiple(self) -> int:
        return 1

    def _capabilities(self) -> Capabilities:
        caps = super()._capabilities()
        return dataclasses.replace(caps, modality="audio", audio_sample_rate=self.sample_rate, alpha=False)

    def _load_preview_map(self, source: str) -> None:
        return None  # no picture to map latents to: previews are drawn (`preview`)

    def _latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    # ---- requests ----

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor]]:
        """`encode_prompt` without guidance: T5's states projected, zero where the tokenizer padded."""
        self._stage("text_encoder", "projection_model")
        embeds = self.pipe.encode_prompt(texts, self.device, do_classifier_free_guidance=False)
        return [(embeds[i : i + 1].clone(),) for i in range(len(texts))]

    def _seconds(self, start: float, end: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode_duration` for one request: the start's and end's embeddings, [1, 1, D] each."""
        out = self.pipe.projection_model(
            start_seconds=torch.tensor([float(start)], device=self.device),
            end_seconds=torch.tensor([float(end)], device=self.device),
        )
        return out.seconds_start_hidden_states, out.seconds_end_hidden_states

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> (embeds [1, L, D],)
        shape = (1, self.transformer.config.in_channels, self.transformer.config.sample_size)
        self._stage("projection_model")  # the seconds' embeddings
        states = []
        for i, (request_id, p) in enumerate(requests):
            (embeds,) = text[p.prompt]
            start, end = self._seconds(p.arguments["audio_start_in_s"], p.arguments["audio_end_in_s"])
            context = torch.cat([embeds, start, end], dim=1)  # [1, L + 2, D]
            global_states = torch.cat([start, end], dim=2)  # [1, 1, 2D]
            cond: dict[str, Any] = {"context": context, "global": global_states}
            if cfg[i]:
                if p.negative_prompt is None:  # the call's negative branch without a negative prompt: zeros
                    negative = torch.zeros_like(context)
                else:
                    negative = torch.cat([text[p.negative_prompt][0], start, end], dim=1)
                cond = {
                    "context": torch.cat([negative, context]),
                    "global": global_states.expand(2, -1, -1),
                    "scale": torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32),
                }
            generator = request_generator(p)
            sampler = SchedulerSampler(self.pipe.scheduler, p.num_inference_steps, self.device, generator=generator)
            latents = randn_tensor(shape, generator=generator, device=self.device, dtype=context.dtype)
            states.append(RequestState(request_id, p, latents * sampler.init_noise_sigma, sampler, cond=cond))
        return states

    # ---- the step ----

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage(self.denoiser)
        cond = self._batched_cond(states)
        rows = cond["context"].shape[0] // len(states)  # 2 with CFG: (negative, positive) per request
        latents = torch.cat([s.sampler.scale_model_input(s.latents) for s in states])  # [B, C, T]
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device)
        batched = {
            "hidden_states": latents.repeat_interleave(rows, dim=0),
            "timestep": timestep.repeat_interleave(rows),
            "encoder_hidden_states": cond["context"],
            "global_hidden_states": cond["global"],
        }
        out = self.ranks.rows(rows, batched, {"rotary_embedding": self.rotary}, states)  # [B, rows, C, T]
        if rows == 1:
            return out[:, 0]
        uncond, text = out[:, 0], out[:, 1]
        return uncond + cond["scale"].to(out.dtype).view(-1, 1, 1) * (text - uncond)

    def predicted_x0(self, state: RequestState, model_output: torch.Tensor) -> torch.Tensor:
        """The scheduler's own denoised estimate (its EDM preconditioning), [C, T]."""
        return state.sampler.predicted_x0(state.latents, model_output)[0]

    # ---- outputs ----

    @torch.inference_mode()
    def decode_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        """The longest clip's waveform of each state [B, channels, samples], float32 (cut in `outputs_of`)."""
        self._stage("vae")
        latents = torch.cat([s.latents for s in states])
        return self.vae.decode(latents.to(self.vae.dtype)).sample.float()

    def outputs_of(self, states: Sequence[RequestState], decoded: torch.Tensor) -> list[np.ndarray]:
        """Each request's waveform [channels, samples], cut to its seconds as the call cuts it; kept on its state for
        `decode_audio`, which hands it on as the result's track at the VAE's sample rate."""
        rate, waves = self.vae.config.sampling_rate, []
        for state, wave in zip(states, decoded, strict=True):
            begin = int(state.params.arguments["audio_start_in_s"] * rate)
            end = int(state.params.arguments["audio_end_in_s"] * rate)
            waves.append(wave[:, begin:end].cpu().numpy())
            state.cond["wave"] = waves[-1]
        return waves

    def decode_audio(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        return [state.cond.pop("wave") for state in states]

    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        raise NotImplementedError("a waveform's result reads its request's seconds (`outputs_of`)")

    def preview(self, x0: torch.Tensor) -> np.ndarray:
        """The latent's channels over time, a band per channel (bright: high), each channel's own range: up to 4
        pixels a channel and a frame (the real checkpoint's 64 x 1024 latent: 256 x 1024 pixels)."""
        x = x0.float()
        low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        grey = ((x - low) / (high - low).clamp_min(1e-6) * 255).round().to(torch.uint8).cpu().numpy()
        tall, wide = (max(1, min(4, side // n)) for side, n in ((256, x.shape[0]), (1024, x.shape[1])))
        grey = grey.repeat(tall, axis=0).repeat(wide, axis=1)
        return np.repeat(grey[:, :, None], 3, axis=2)

    @torch.inference_mode()
    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray]:
        """Predicted clean latents [B, C, T] decoded: each waveform's envelope, a band per channel."""
        self._stage("vae")
        audio = self.vae.decode(x0.to(self.vae.dtype)).sample.float().clamp(-1, 1).cpu().numpy()
        return [envelope(wave) for wave in audio]


def envelope(wave: np.ndarray) -> np.ndarray:
    """uint8 [channels * WAVE_HEIGHT, WAVE_WIDTH, 3]: per column, the span of the samples it covers, white on black."""
    picture = np.zeros((wave.shape[0] * WAVE_HEIGHT, WAVE_WIDTH, 3), dtype=np.uint8)
    columns = np.array_split(np.arange(wave.shape[1]), WAVE_WIDTH)
    rows = np.arange(WAVE_HEIGHT)[:, None]
    for c, channel in enumerate(wave):
        lo = np.array([channel[i].min() if len(i) else 0.0 for i in columns])
        hi = np.array([channel[i].max() if len(i) else 0.0 for i in columns])
        # Row r shows amplitude 1 - 2r / (H - 1): lit where it lies inside [lo, hi] of its column.
        level = 1 - 2 * rows / (WAVE_HEIGHT - 1)
        lit = (level >= lo[None] - 1 / WAVE_HEIGHT) & (level <= hi[None] + 1 / WAVE_HEIGHT)
        picture[c * WAVE_HEIGHT : (c + 1) * WAVE_HEIGHT][lit] = 255
    return picture


class AudioRequests(RequestRules):
    """No size: `audio_start_in_s` and `audio_end_in_s` by name in `arguments` (the call's own, its defaults 0 and
    the longest clip), checked as the call's `check_inputs` and a little more (an empty clip is refused)."""

    def __init__(self, caps: Any, declared: Any, *, longest: float, bounds: tuple[float, float], **parts: Any) -> None:
        self.longest = longest
        self.call_arguments = {
            "audio_start_in_s": (float, 0.0, (float(bounds[0]), float(bounds[1]))),
            "audio_end_in_s": (float, longest, (float(bounds[0]), float(bounds[1]))),
        }
        super().__init__(caps, declared, **parts)

    def uses_cfg(self, params: SamplingParams) -> bool:
        return (params.guidance_scale or 0.0) > 1.0  # the call's `do_classifier_free_guidance`

    def batch_key(self, params: SamplingParams) -> Any:
        return self.uses_cfg(params)  # every clip denoises the longest clip's frames

    def _size(self, params: SamplingParams) -> tuple[None, None]:
        for name in ("width", "height"):
            if getattr(params, name) is not None:
                raise ParamError(name, f"the {self.family} family makes sound; its length is arguments.audio_end_in_s")
        return None, None

    def _call_arguments(self, params: SamplingParams) -> dict[str, Any] | None:
        out = super()._call_arguments(params)
        assert out is not None
        start, end = out["audio_start_in_s"], out["audio_end_in_s"]
        if end <= start:
            raise ParamError("arguments", f"audio_end_in_s ({end:g}) must be after audio_start_in_s ({start:g})")
        if end - start > self.longest:
            raise ParamError(
                "arguments", f"the clip is {end - start:g} s; this checkpoint makes at most {self.longest:g} s"
            )
        return out


class _AudioBlock:
    """A Stable Audio DiT block as `cached_blocks` calls blocks: its cross-attention context passed through as it
    came (no mask: the call sends none), its input the global token and the latent frames."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __call__(self, hidden_states, encoder_hidden_states, temb, rotary_embedding):
        out = self.block(
            hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, rotary_embedding=rotary_embedding
        )
        return encoder_hidden_states, out


def _audio_modulated(wrapped: _AudioBlock, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """TeaCache's signal for Stable Audio: its blocks take no adaptive norm (the timestep rides in the global token
    before the frames), so the first block's normed input, which carries it."""
    return wrapped.block.norm1(h)


@torch.inference_mode()
def stable_audio_forward(
    method: Method,
    batched: dict[str, torch.Tensor],
    shared: dict[str, Any],
    rows: int,
    states: Sequence[Any],
    *,
    transformer: Any,
) -> torch.Tensor:
    """`StableAudioDiTModel.forward` over B requests x `rows` rows, with a cache decision per request. Returns the
    model output [B * rows, C, T]."""
    t = transformer
    context = t.cross_attention_proj(batched["encoder_hidden_states"])
    time = t.timestep_proj(t.time_proj(batched["timestep"].to(t.dtype)))  # [B * rows, D]
    global_states = t.global_proj(batched["global_hidden_states"]) + time.unsqueeze(1)
    x = batched["hidden_states"]
    h = t.proj_in((t.preprocess_conv(x) + x).transpose(1, 2))
    h = torch.cat([global_states, h], dim=-2)
    blocks = [_AudioBlock(block) for block in t.transformer_blocks]
    batch = Batch(
        h, context, time, rows, states, narrows=lora_narrows(t), context=True,
        block_kwargs={"rotary_embedding": shared["rotary_embedding"]},
    )  # fmt: skip
    out = cached_blocks(method, blocks, batch, modulated=_audio_modulated)
    out = t.proj_out(out).transpose(1, 2)[:, :, 1:]
    return t.postprocess_conv(out) + out
