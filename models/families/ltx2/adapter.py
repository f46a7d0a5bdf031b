"""LTX-2 (`LTX2Pipeline`): video with sound. One transformer denoises a clip's video tokens and its audio tokens
together (each attends to the other), read from a Gemma 3 text encoder through per-modality connectors; a causal
video VAE (32x spatial, 8x temporal: a clip of 1 + 8k frames has 1 + k latent frames), an audio VAE (mel
spectrogram latents, 25 per second) and a vocoder (the waveform, 24 kHz stereo).

A request's latents are its video tokens and its audio tokens flattened and laid end to end ([1, video + audio]),
so the batched Euler step, x0 and the engine's bookkeeping treat them as one tensor; the adapter splits them for
the transformer and the decoders. Both modalities share the request's sigmas, as the pipeline's two schedulers do.

Guidance, as the pipeline's: in x0 space, the positive prediction plus a CFG delta (against the negative prompt),
an STG delta (against the prediction with self-attention perturbed in `stg_blocks`) and a modality delta (against
the prediction with the audio <-> video cross-attention off), each with a video and an audio scale, then each
modality's guidance rescale. A batch runs one transformer call for every request's CFG rows, one per set of STG
blocks among the requests that use STG, and one for the requests that use modality guidance: the pipeline's three
passes, with rows of any number of requests. Step caches decide per row of those calls (models/families/ltx2/cache.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable, Sequence
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg
from diffusers.pipelines.ltx2.utils import (
    apply_image_conditioning_crf,
    conditioning_frame_rate,
    resolve_default_image_crf,
)
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor
from PIL import Image

from diffusiond.kernels.ulysses import UlyssesGroup
from diffusiond.models.base import Capabilities, RequestState
from diffusiond.models.families import specs
from diffusiond.models.families.ltx2 import ulysses as ltx2_ulysses
from diffusiond.models.families.ltx2.cache import ltx2_forward, pack
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.clips import VideoClips
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import request_generator
from diffusiond.models.inputs import open_rgb
from diffusiond.models.params import MAX_GUIDANCE, ParamError, SamplingParams
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.span import RowState

# The pipeline's `__call__` defaults besides `guidance_scale` (video CFG, the family's default guidance).
AUDIO_VIDEO_DEFAULTS: dict[str, float] = {
    "audio_guidance_scale": 7.0,
    "stg_scale": 1.0,
    "audio_stg_scale": 1.0,
    "modality_scale": 3.0,
    "audio_modality_scale": 3.0,
    "guidance_rescale": 0.7,
    "audio_guidance_rescale": 0.7,
}
# The pipeline's default `spatio_temporal_guidance_blocks` (LTX-2.3's recommendation; LTX-2.0's is 29).
DEFAULT_STG_BLOCKS = (28,)
# The pipeline's prompt length (Gemma's padded sequence: the connectors' registers fill it).
TEXT_TOKENS = 1024
# The VAE decoder pads two latent pixels by reflection: a side of one latent pixel cannot decode.
MIN_SIDE = 64


class Layout:
    """Where a request's video and audio tokens lie in its flat latents, for one size, frame count and rate."""

    __slots__ = ("audio", "audio_features", "frames", "height", "video", "video_features", "width")

    def __init__(self, frames: int, height: int, width: int, video_features: int, audio: int, audio_features: int):
        self.frames, self.height, self.width = frames, height, width  # latent frames and sides
        self.video, self.video_features = frames * height * width, video_features  # tokens, features
        self.audio, self.audio_features = audio, audio_features

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N] -> video tokens [B, S_v, C_v], audio tokens [B, S_a, C_a]."""
        cut = self.video * self.video_features
        video = flat[:, :cut].reshape(-1, self.video, self.video_features)
        return video, flat[:, cut:].reshape(-1, self.audio, self.audio_features)


class LTX2Adapter(FlowMatchAdapter):
    spec = specs.LTX2
    default_steps = 30
    default_guidance = 3.0
    # The pipeline's defaults: 121 frames of 768x512 at 24 frames per second.
    default_num_frames: ClassVar[int] = 121
    default_fps: ClassVar[int] = 24
    TEXT_ENCODERS = ("text_encoder", "connectors")

    def __init__(self, pipe: Any, *, source: str, lazy: Any = None) -> None:
        self.frame_step = pipe.vae_temporal_compression_ratio
        self.audio_vae, self.vocoder = pipe.audio_vae, pipe.vocoder
        self.sample_rate = int(self.vocoder.config.output_sampling_rate)
        # Audio latents per second of clip: mel frames per second over the audio VAE's temporal compression.
        mel_rate = pipe.audio_sampling_rate / pipe.audio_hop_length
        self.audio_rate = mel_rate / float(pipe.audio_vae_temporal_compression_ratio)
        self.mel_bins = self.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio  # latent mel bins
        # STG perturbs self-attention only in blocks built for it (`perturbed_attn`); elsewhere the pass would
        # repeat the positive prediction, and its delta would be zero.
        self.stg_capable = bool(pipe.transformer.config.get("perturbed_attn", False))
        super().__init__(pipe, source=source, lazy=lazy)
        # The image-to-video pipeline's processor resizes the first frame bilinearly (the text-to-video one's, bicubic).
        self.first_frame_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor, resample="bilinear")

    def _step_cache(self) -> StepCache:
        cached = partial(ltx2_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def _call(self, batched: dict[str, Any], shared: dict[str, Any]) -> torch.Tensor:
        video, audio = self.transformer(**batched)
        return pack(video.float(), audio.float())

    def _clips(self) -> VideoClips:
        return VideoClips(
            frame_step=self.frame_step,
            max_frames=8 * 60 + 1,  # 20 seconds at 24 frames per second, the pipeline's longest predicted duration
            default_num_frames=self.default_num_frames,
            default_fps=self.default_fps,
            processor=self.pipe.video_processor,
            latent_rgb=self.latent_rgb,
            requires_image=self.requires_image,
        )

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        blocks = len(self.transformer.transformer_blocks)
        return LTX2Requests(caps, declared, blocks=blocks, **parts)

    # ---- capabilities and requests ----

    def _vae_scale_factor(self, pipe: Any) -> int:
        return pipe.vae_spatial_compression_ratio

    def _default_size(self) -> tuple[int, int]:
        return 768, 512

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size

    def _latent_channels(self) -> int:
        return self.vae.config.latent_channels

    def _capabilities(self) -> Capabilities:
        return dataclasses.replace(super()._capabilities(), audio_sample_rate=self.sample_rate)

    def _uses_stg(self, params: SamplingParams) -> bool:
        stg = (params.stg_scale or 0.0) > 0.0 or (params.audio_stg_scale or 0.0) > 0.0
        return stg and self.stg_capable and params.stg_blocks is not None

    def _uses_modality(self, params: SamplingParams) -> bool:
        return (params.modality_scale or 0.0) > 1.0 or (params.audio_modality_scale or 0.0) > 1.0

    def _patches(self) -> tuple[int, int]:
        """The transformer's spatial and temporal patch sizes."""
        return self.transformer.config.patch_size, self.transformer.config.patch_size_t

    def layout(self, p: SamplingParams) -> Layout:
        assert p.num_frames is not None and p.height is not None and p.width is not None and p.fps is not None
        config = self.transformer.config
        s, ps = self.vae_scale_factor, config.patch_size
        frames = ((p.num_frames - 1) // self.frame_step + 1) // config.patch_size_t
        audio = round(p.num_frames / float(p.fps) * self.audio_rate)
        height, width = p.height // s // ps, p.width // s // ps
        return Layout(frames, height, width, config.in_channels, audio, config.audio_in_channels)

    # ---- prepare ----

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        """Each text as the pipeline conditions on it: Gemma's stacked hidden states through the connectors, per
        modality ([1, 1024, D] video and audio, and their mask)."""
        self._stage(*self.TEXT_ENCODERS)
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompt=texts, do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS, device=self.device
        )
        padding = getattr(self.pipe.tokenizer, "padding_side", "left")
        video, audio, mask = self.pipe.connectors(embeds, mask, padding_side=padding)
        return [(video[i : i + 1], audio[i : i + 1], mask[i : i + 1]) for i in range(len(texts))]

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)
        states = []
        for i, (request_id, p) in enumerate(requests):
            layout = self.layout(p)
            generator = request_generator(p)
            # As the pipeline draws them, float32: the video's noise, then the audio's, from the request's generator.
            shape = (1, self.vae.config.latent_channels, layout.frames, layout.height, layout.width)
            cond: dict[str, Any] = {}
            if p.image is not None:  # encoded before the noise is drawn, as the image-to-video pipeline
                first = self._first_frame(p).repeat(1, 1, layout.frames, 1, 1)
                mask = torch.zeros((1, 1, *shape[2:]), device=self.device, dtype=torch.float32)
                mask[:, :, 0] = 1.0
                noise = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
                video = self.pipe._pack_latents(first * mask + noise * (1 - mask), *self._patches())
                cond["first_frame"] = self.pipe._pack_latents(mask, *self._patches()).squeeze(-1)  # [1, S_v]
            else:
                video = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
                video = self.pipe._pack_latents(video, *self._patches())
            shape = (1, self.audio_vae.config.latent_channels, layout.audio, self.mel_bins)
            audio = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
            audio = self.pipe._pack_audio_latents(audio)  # [1, L, C * M]
            latents = torch.cat([video.flatten(1), audio.flatten(1)], dim=1)  # [1, N]
            steps = p.num_inference_steps
            config = self.pipe.scheduler.config
            mu = calculate_shift(
                layout.video,
                config.get("base_image_seq_len", 1024),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.95),
                config.get("max_shift", 2.05),
            )
            sampler = self._sampler(p, generator, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
            texts = {"positive": text[p.prompt]}
            if cfg[i]:
                texts["negative"] = text[p.negative_prompt or ""]
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, shared=texts))
        return states

    def _first_frame(self, p: SamplingParams) -> torch.Tensor:
        """As LTX2ImageToVideoPipeline: the image re-compressed as the model was trained (H.264 at the text encoder
        generation's CRF), resized to the clip's size, the VAE's mode, normalized: [1, C, 1, h, w] float32."""
        self._stage("vae")
        image = open_rgb(p.image)
        crf = resolve_default_image_crf(self.pipe.text_encoder)
        if crf != 0:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
        pixels = self.first_frame_processor.preprocess(image, height=p.height, width=p.width)
        pixels = pixels.to(self.device, self.dtype).unsqueeze(2)  # [1, 3, 1, H, W]
        latents = retrieve_latents(self.vae.encode(pixels.to(self.vae.dtype)), None, "argmax").to(torch.float32)
        return self.pipe._normalize_latents(latents, self.vae.latents_mean, self.vae.latents_std)

    # ---- denoise ----

    def _transformer_call(
        self,
        rows: list[tuple[int, str]],
        states: Sequence[RequestState],
        video: torch.Tensor,
        audio: torch.Tensor,
        layout: Layout,
        *,
        isolate: bool = False,
        stg_blocks: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """One transformer call over `rows` (state index, "positive" or "negative" prompt): float32 velocities of
        the video and the audio, each row's flattened end to end ([R, S_v * C_v + S_a * C_a])."""
        index = torch.tensor([i for i, _ in rows], device=video.device)
        texts = [states[i].shared[which] for i, which in rows]
        timestep = torch.stack([states[i].sampler.timestep for i, _ in rows]).to(self.device)  # [R]
        video_timestep = timestep
        if "first_frame" in states[0].cond:  # a timestep per video token, 0 on the given frame's: [R, S_v]
            mask = torch.cat([states[i].cond["first_frame"] for i, _ in rows])
            video_timestep = timestep.unsqueeze(-1) * (1 - mask)
        p = states[0].params
        fps = conditioning_frame_rate(float(p.fps), 1.0)
        count = len(rows)
        video_coords = self.transformer.rope.prepare_video_coords(
            count, layout.frames, layout.height, layout.width, self.device, fps=fps
        )
        audio_coords = self.transformer.audio_rope.prepare_audio_coords(count, layout.audio, self.device)
        mask = torch.cat([t[2] for t in texts])
        arguments = dict(
            hidden_states=video[index].to(self.dtype),
            audio_hidden_states=audio[index].to(self.dtype),
            encoder_hidden_states=torch.cat([t[0] for t in texts]),
            audio_encoder_hidden_states=torch.cat([t[1] for t in texts]),
            timestep=video_timestep,
            audio_timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=layout.frames,
            height=layout.height,
            width=layout.width,
            fps=fps,
            audio_num_frames=layout.audio,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=list(stg_blocks) if stg_blocks else None,
            perturbation_mask=None,
            use_cross_timestep=True,
            return_dict=False,
        )
        # For a step cache, each row's own cache: its pass and prompt.
        key = "modality" if isolate else ("stg", stg_blocks) if stg_blocks else "cfg"
        row_states = [RowState(states[i], (key, which), (key, which) == ("cfg", "positive")) for i, which in rows]
        with self.loras.rows([self.loras.of(states[i]) for i, _ in rows]):
            return self.cache.forward(arguments, {}, 1, row_states)

    def step_rows(self, states: Sequence[RequestState]) -> list[tuple[Hashable, int, str]]:
        """Every transformer row of the states' step: (pass, state index, prompt), grouped by pass (a call each):
        "cfg" (a negative row where the request has CFG, and its positive), ("stg", blocks), "modality"."""
        items: list[tuple[Hashable, int, str]] = []
        for i, s in enumerate(states):
            items += [("cfg", i, "negative")] if "negative" in s.shared else []
            items.append(("cfg", i, "positive"))
        stg = [(("stg", s.params.stg_blocks), i, "positive") for i, s in enumerate(states) if self._uses_stg(s.params)]
        items += sorted(stg, key=lambda item: item[0][1])
        items += [("modality", i, "positive") for i, s in enumerate(states) if self._uses_modality(s.params)]
        return items

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        """The guided velocities of every state, flat as their latents ([B, N]), from one call per guidance pass.
        With CFG-parallel, the rows of all passes are split between the two ranks (a request's negative and
        positive rows on one, its STG and modality rows on the other) and the outputs all-gathered."""
        self._stage(self.denoiser)
        layout = self.layout(states[0].params)
        video, audio = layout.split(torch.cat([s.latents for s in states]))  # float32
        items = self.step_rows(states)
        width = video[0].numel() + audio[0].numel()

        def compute(lo: int, hi: int) -> torch.Tensor:
            outs = [video.new_zeros((0, width))]
            for key, group in itertools.groupby(items[lo:hi], key=lambda item: item[0]):
                rows = [(i, which) for _, i, which in group]
                kwargs: dict[str, Any] = {"isolate": key == "modality"}
                if isinstance(key, tuple):
                    kwargs["stg_blocks"] = key[1]
                outs.append(self._transformer_call(rows, states, video, audio, layout, **kwargs))
            return torch.cat(outs)  # [hi - lo, N]

        flat = compute(0, len(items)) if self.ranks.cfg_group is None else self.ranks.split_by(len(items), compute)
        passes: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for r, (key, i, which) in enumerate(items):
            name = which if key == "cfg" else "stg" if isinstance(key, tuple) else "modality"
            passes.setdefault(name, {})[i] = layout.split(flat[r : r + 1])
        out = []
        for i, s in enumerate(states):
            p = s.params
            sigma = s.sampler.device_sigmas[s.sampler.index]
            others = {name: rows[i] for name, rows in passes.items() if i in rows and name != "positive"}
            video_scales = (p.guidance_scale, p.stg_scale, p.modality_scale, p.guidance_rescale)
            audio_scales = (p.audio_guidance_scale, p.audio_stg_scale, p.audio_modality_scale, p.audio_guidance_rescale)
            guided = [
                _guide(x[i : i + 1], passes["positive"][i][m], {k: v[m] for k, v in others.items()}, sigma, *scales)
                for m, (x, scales) in enumerate(((video, video_scales), (audio, audio_scales)))
            ]
            if "first_frame" in s.cond:  # the given frame's tokens stay as they are: no velocity
                guided[0] = guided[0] * (1 - s.cond["first_frame"]).unsqueeze(-1)
            out.append(torch.cat([g.flatten(1) for g in guided], dim=1))
        return torch.cat(out)

    # ---- parallel ----

    def attention_heads(self) -> int | None:
        """What a Ulysses degree must divide: the video's heads and the audio's (which the audio <-> video
        cross-attentions use too)."""
        config = self.transformer.config
        return math.gcd(config.num_attention_heads, config.audio_num_attention_heads)

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        """Video and audio tokens both sharded across `group` (models/families/ltx2/ulysses.py)."""
        self.ranks.ulysses = group
        ltx2_ulysses.enable(self.transformer, group)

    # ---- decode ----

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Flat latents [B, N] -> the video's latents [B, C, T, h, w]."""
        layout = self.layout(params)
        video, _ = layout.split(latents)
        return self.pipe._unpack_latents(video, layout.frames, layout.height, layout.width, *self._patches())

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Video latents [B, C, T, h, w] -> the VAE's clips [B, 3, F, H, W] in [-1, 1]; single images [B, C, h, w]
        (preview map fitting) decode as one-frame clips, to [B, 3, H, W]."""
        if latents.dim() == 4:
            return self._decode(latents[:, :, None])[:, :, 0]
        vae = self.vae
        timestep = None
        if vae.config.timestep_conditioning:
            # The pipeline's default decode timestep and noise scale, 0: the latents unchanged, timestep 0.
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
        latents = self.pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]

    @torch.inference_mode()
    def decode_audio(self, states: Sequence[RequestState]) -> list[np.ndarray]:
        """The vocoder's waveform of each finished state: float32 [channels, samples] at `sample_rate`."""
        self._stage("audio_vae", "vocoder")
        layout = self.layout(states[0].params)
        _, audio = layout.split(torch.cat([s.latents for s in states]))
        audio = self.pipe._denormalize_audio_latents(audio, self.audio_vae.latents_mean, self.audio_vae.latents_std)
        audio = self.pipe._unpack_audio_latents(audio, layout.audio, num_mel_bins=self.mel_bins)  # [B, C, L, M]
        mel = self.audio_vae.decode(audio.to(self.audio_vae.dtype), return_dict=False)[0]
        waves = self.vocoder(mel).float().cpu().numpy()  # [B, channels, samples]
        return list(waves)


class LTX2Requests(RequestRules):
    """`blocks`: the transformer's blocks (STG's range)."""

    @property
    def default_stg_blocks(self) -> tuple[int, ...] | None:
        assert self.blocks is not None
        return tuple(b for b in DEFAULT_STG_BLOCKS if b < self.blocks) or None

    def uses_cfg(self, params: SamplingParams) -> bool:
        """The pipeline's `do_classifier_free_guidance`: either modality's CFG."""
        return (params.guidance_scale or 0.0) > 1.0 or (params.audio_guidance_scale or 0.0) > 1.0

    def batch_key(self, params: SamplingParams) -> Hashable:
        # Rows of requests with and without each guidance pass share the calls: the token grid and its rate (the
        # positions' time axis) must match, and whether the first frame is given (a timestep per token then).
        return (params.width, params.height, params.num_frames, params.fps, params.image is not None)

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        for name in ("width", "height"):
            if getattr(resolved, name) < MIN_SIDE:
                side = getattr(resolved, name)
                raise ParamError(name, f"{name} must be at least {MIN_SIDE} for this model, got {side}")
        return resolved

    def _audio_video_guidance(self, params: SamplingParams) -> dict[str, Any]:
        resolved: dict[str, Any] = {}
        for name, default in AUDIO_VIDEO_DEFAULTS.items():
            value = getattr(params, name)
            value = float(value if value is not None else default)
            if not math.isfinite(value) or not 0 <= value <= MAX_GUIDANCE:
                raise ParamError(name, f"{name} must be between 0 and {MAX_GUIDANCE:g}, got {value}")
            resolved[name] = value
        blocks = params.stg_blocks
        if blocks is not None:
            count = self.blocks
            if max(blocks) >= count:
                message = f"this model's transformer has blocks 0 to {count - 1}, got {max(blocks)}"
                raise ParamError("stg_blocks", message)
            blocks = tuple(sorted(set(blocks)))
        resolved["stg_blocks"] = blocks if blocks is not None else self.default_stg_blocks
        return resolved


def _guide(
    x: torch.Tensor,
    positive: torch.Tensor,
    others: dict[str, torch.Tensor],
    sigma: torch.Tensor,
    scale: float,
    stg: float,
    modality: float,
    rescale: float,
) -> torch.Tensor:
    """One modality of one request, as the pipeline guides it: velocities to x0 (`x - v sigma`), the positive x0
    plus each pass's delta, rescaled, and back to a velocity."""
    x0 = x - positive * sigma
    cfg = (scale - 1) * (x0 - (x - others["negative"] * sigma)) if "negative" in others else 0
    stg_delta = stg * (x0 - (x - others["stg"] * sigma)) if "stg" in others else 0
    modality_delta = (modality - 1) * (x0 - (x - others["modality"] * sigma)) if "modality" in others else 0
    guided = x0 + cfg + stg_delta + modality_delta
    if rescale > 0:
        guided = rescale_noise_cfg(guided, x0, guidance_rescale=rescale)
    return (x - guided) / sigma


class LTX2I2VAdapter(LTX2Adapter):
    """A checkpoint saved as `LTX2ImageToVideoPipeline`: the same components, every request animating its image."""

    spec = specs.LTX2_I2V
    requires_image = True
