"""HunyuanVideo-1.5 (`HunyuanVideo15Pipeline`, `HunyuanVideo15ImageToVideoPipeline`): a dual-stream transformer over
frames x height x width latent tokens (the noise, the condition latents and a mask channel), reading a Qwen2.5-VL
text encoder (its third-to-last hidden state, 1000 tokens after the chat template's system prefix), a ByT5 encoder
of the prompt's "quoted" glyph text (256 tokens) and, image to video, a SigLIP embedding of the first frame
(729 tokens; text to video passes zeros); a causal video VAE (16x spatial, 4x temporal: a clip of 1 + 4k frames has
1 + k latent frames); flow-match Euler on the pipeline's linear sigmas, shifted by the checkpoint's scheduler.

Guidance is the checkpoint's guider (`ClassifierFreeGuidance`): its scale is each request's `guidance_scale`
(default: the guider's), its rescale, formulation and step range the checkpoint's. The pipeline runs the prompt and
the negative prompt in two transformer calls; here one call takes every request's rows (a negative row where the
request guides at that step). The transformer tells text from image to video by whether every row's image embedding
is zero, so the two batch apart. Step caches decide per row (`cached_forward`): a negative row runs only on the
guided steps, so it keeps a cache of its own.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.guiders.guider_utils import rescale_noise_cfg
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from diffusiond.kernels.attention import attention
from diffusiond.kernels.ulysses import UlyssesGroup, ulysses_sdpa
from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.clips import VideoClips
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import request_generator
from diffusiond.models.inputs import image_size, open_rgb
from diffusiond.models.params import MAX_FRAMES, ParamError, SamplingParams
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.forwards import lora_narrows
from diffusiond.models.stepcache.methods import Batch, Method, cached_blocks, settle
from diffusiond.models.stepcache.span import RowState, TextFirst, sigmas, spanned


class HunyuanVideo15Adapter(FlowMatchAdapter):
    spec = specs.HUNYUAN_VIDEO_15
    default_steps = 50
    # The pipeline's 121 frames; it names no rate (its examples write 24 frames per second).
    default_num_frames: ClassVar[int] = 121
    default_fps: ClassVar[int] = 24
    TEXT_ENCODERS = ("text_encoder", "text_encoder_2")

    def __init__(self, pipe: Any, *, source: str, lazy: Any = None) -> None:
        self.frame_step = pipe.vae_scale_factor_temporal
        self.guider = pipe.guider
        self.default_guidance = float(self.guider.guidance_scale)
        super().__init__(pipe, source=source, lazy=lazy)
        for block in self.transformer.transformer_blocks:  # a key mask, not the pipeline's [B, 1, L, L] one
            block.attn.set_processor(Hunyuan15AttnProcessor())

    # ---- capabilities and requests ----

    def _vae_scale_factor(self, pipe: Any) -> int:
        return pipe.vae_scale_factor_spatial

    def _default_size(self) -> tuple[int, int]:
        """The pipeline's: the 16:9 bucket at the transformer's `target_size`."""
        height, width = self.pipe.video_processor.calculate_default_height_width(9, 16, self.pipe.target_size)
        return width, height

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size

    def _latent_channels(self) -> int:
        return self.vae.config.latent_channels

    def _clips(self) -> VideoClips:
        return VideoClips(
            frame_step=self.frame_step,
            max_frames=min(MAX_FRAMES, 4 * 60 + 1),  # 10 seconds at 24 frames per second
            default_num_frames=self.default_num_frames,
            default_fps=self.default_fps,
            processor=self.pipe.video_processor,
            latent_rgb=self.latent_rgb,
            requires_image=self.requires_image,
        )

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        bucket = partial(self.pipe.video_processor.calculate_default_height_width, target_size=self.pipe.target_size)
        return Hunyuan15Requests(caps, declared, guider=self.guider, bucket=bucket, **parts)

    def _guides_at(self, state: RequestState) -> bool:
        """Whether the request runs its negative row at its next step (the guider's `start` and `stop`)."""
        if "negative" not in state.shared:
            return False
        steps = state.params.num_inference_steps
        return int(self.guider._start * steps) <= state.sampler.index < int(self.guider._stop * steps)

    # ---- prepare ----

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        """Each text as the pipeline encodes it: the Qwen embedding and mask, the ByT5 glyph embedding and mask."""
        self._stage(*self.TEXT_ENCODERS)
        out = self.pipe.encode_prompt(prompt=texts, device=self.device, dtype=self.dtype, batch_size=len(texts))
        return [tuple(t[i : i + 1] for t in out) for i in range(len(texts))]

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)
        states = []
        for i, (request_id, p) in enumerate(requests):
            assert p.num_frames is not None and p.height is not None and p.width is not None
            generator = request_generator(p)
            s = self.vae_scale_factor
            shape = (1, self.vae.config.latent_channels, (p.num_frames - 1) // self.frame_step + 1, p.height // s,
                     p.width // s)  # fmt: skip
            # In the transformer's dtype, as the pipeline draws and steps them.
            latents = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
            steps = p.num_inference_steps
            sampler = self._sampler(p, generator, sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
            condition = torch.zeros((1, shape[1] + 1, *shape[2:]), device=self.device, dtype=self.dtype)
            embeds = torch.zeros(
                (1, self.pipe.vision_num_semantic_tokens, self.transformer.config.image_embed_dim),
                device=self.device,
                dtype=self.dtype,
            )
            if p.image is not None:
                condition, embeds = self._first_frame(p, condition)
            texts = {"positive": text[p.prompt]}
            if cfg[i]:
                texts["negative"] = text[p.negative_prompt or ""]
            cond = {"condition": condition, "image_embeds": embeds}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, shared=texts))
        return states

    def _first_frame(self, p: SamplingParams, condition: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As the image-to-video pipeline: the image cropped to the clip's size; its VAE latent (mode, scaled) as the
        first latent frame's condition with a mask of 1 there, and its SigLIP embedding."""
        image = self.pipe.video_processor.resize(open_rgb(p.image), height=p.height, width=p.width, resize_mode="crop")
        self._stage("image_encoder")
        embeds = self.pipe.encode_image(image=image, batch_size=1, device=self.device, dtype=self.dtype)
        self._stage("vae")
        pixels = self.pipe.video_processor.preprocess(image, height=p.height, width=p.width)
        pixels = pixels.to(self.device, self.vae.dtype).unsqueeze(2)  # [1, 3, 1, H, W]
        latent = retrieve_latents(self.vae.encode(pixels), sample_mode="argmax") * self.vae.config.scaling_factor
        channels = latent.shape[1]
        condition = condition.clone()
        condition[:, :channels, :1] = latent.to(self.dtype)
        condition[:, channels, 0] = 1.0
        return condition, embeds

    # ---- denoise ----

    def _transformer_call(
        self, rows: list[tuple[int, str]], states: Sequence[RequestState], latents: torch.Tensor
    ) -> torch.Tensor:
        """One transformer call over `rows` (state index, "positive" or "negative"): [R, C, T, h, w]."""
        index = torch.tensor([i for i, _ in rows], device=latents.device)
        texts = [states[i].shared[which] for i, which in rows]
        condition = torch.cat([states[i].cond["condition"] for i, _ in rows])
        hidden = torch.cat([latents[index], condition], dim=1)  # [R, C + C + 1, T, h, w]
        timestep = torch.stack([states[i].sampler.timestep for i, _ in rows]).to(self.device, self.dtype)
        kwargs: dict[str, Any] = {}
        if self.transformer.config.use_meanflow:  # the step's end: the next timestep, 0 after the last
            ends = []
            for i, _ in rows:
                sampler = states[i].sampler
                later = sampler.timesteps[sampler.index + 1 :]
                ends.append(later[0] if len(later) else torch.tensor(0.0, device=self.device))
            kwargs["timestep_r"] = torch.stack(ends).to(self.device, self.dtype)
        arguments = dict(
            hidden_states=hidden,
            image_embeds=torch.cat([states[i].cond["image_embeds"] for i, _ in rows]),
            timestep=timestep,
            encoder_hidden_states=torch.cat([t[0] for t in texts]),
            encoder_attention_mask=torch.cat([t[1] for t in texts]),
            encoder_hidden_states_2=torch.cat([t[2] for t in texts]),
            encoder_attention_mask_2=torch.cat([t[3] for t in texts]),
            return_dict=False,
            **kwargs,
        )
        # A step cache's rows: each its own (a negative row runs only on the guided steps).
        row_states = [RowState(states[i], which, which == "positive") for i, which in rows]
        with self.loras.rows([self.loras.of(states[i]) for i, _ in rows]):
            return self.cache.forward(arguments, {}, 1, row_states)

    def _step_cache(self) -> StepCache:
        return StepCache(
            self.family, self.cache_methods, self._call, partial(cached_forward, transformer=self.transformer)
        )

    def _call(self, batched: dict[str, Any], shared: dict[str, Any]) -> torch.Tensor:
        return self.transformer(**batched)[0]

    def step_rows(self, states: Sequence[RequestState]) -> list[tuple[int, str]]:
        """The rows of the states' step: (state index, prompt), a negative after a positive where it guides now."""
        rows: list[tuple[int, str]] = []
        for i, s in enumerate(states):
            rows += [(i, "positive"), *([(i, "negative")] if self._guides_at(s) else [])]
        return rows

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        """One call over every request's rows (its negative too where it guides at this step; with CFG-parallel the
        rows split between the two ranks); each request guided as the checkpoint's guider does."""
        self._stage(self.denoiser)
        latents = torch.cat([s.latents for s in states])
        rows = self.step_rows(states)

        def compute(lo: int, hi: int) -> torch.Tensor:
            if lo == hi:
                return latents.new_zeros((0, *latents.shape[1:]))
            return self._transformer_call(rows[lo:hi], states, latents)

        out = compute(0, len(rows)) if self.ranks.cfg_group is None else self.ranks.split_by(len(rows), compute)
        guide = self.guider
        guided = []
        r = 0
        for s in states:
            cond = out[r : r + 1]
            pred = cond
            if self._guides_at(s):
                uncond = out[r + 1 : r + 2]
                base = cond if guide.use_original_formulation else uncond
                pred = base + s.params.guidance_scale * (cond - uncond)
            if guide.guidance_rescale > 0.0:
                pred = rescale_noise_cfg(pred, cond, guide.guidance_rescale)
            guided.append(pred)
            r += 2 if self._guides_at(s) else 1
        return torch.cat(guided)

    # ---- parallel ----

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        """The frames x height x width tokens are sharded across `group` from the first block on (with their rotary
        angles); each block's joint attention all-to-alls the video shard and keeps the text whole on every rank
        (`Hunyuan15AttnProcessor`); the last block's video output is gathered for the output projection."""
        self.ranks.ulysses = group
        blocks = self.transformer.transformer_blocks
        span: dict[str, int] = {}

        def shard(module, args):
            # The blocks are called positionally: (video, text, temb, text mask, (cos, sin)).
            video, text, temb, mask, (cos, sin) = args
            if module is blocks[0]:
                span["start"], span["stop"] = group.split(video.shape[1])
                video = video[:, span["start"] : span["stop"]]
            local = slice(span["start"], span["stop"])
            return (video, text, temb, mask, (cos[local], sin[local]))

        def gather(module, args, output):
            video, text = output
            return group.gather_seq(video), text

        for block in blocks:
            block.attn.set_processor(Hunyuan15AttnProcessor(group))
            block.register_forward_pre_hook(shard)
        blocks[-1].register_forward_hook(gather)

    # ---- decode ----

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, T, h, w] latents -> the VAE's clips [B, 3, F, H, W] in [-1, 1], one clip per call (diffusers 0.42's
        decoder mid-block attention mask broadcasts wrongly over several); single images [B, C, h, w] (preview map
        fitting) decode as one-frame clips, to [B, 3, H, W]."""
        if latents.dim() == 4:
            return self._decode(latents[:, :, None])[:, :, 0]
        latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        return torch.cat([self.vae.decode(latents[i : i + 1], return_dict=False)[0] for i in range(len(latents))])


class Hunyuan15Requests(RequestRules):
    """`guider`: the checkpoint's guider; `bucket(height, width)`: the pipeline's size bucket of an image's aspect at
    its `target_size`, as (height, width)."""

    def __init__(self, caps: Any, declared: Any, *, guider: Any, bucket: Any, **parts: Any) -> None:
        super().__init__(caps, declared, **parts)
        self.guider, self.bucket = guider, bucket

    def uses_cfg(self, params: SamplingParams) -> bool:
        """The guider's: on unless the scale is its neutral value (1; 0 in the original formulation)."""
        neutral = 0.0 if self.guider.use_original_formulation else 1.0
        return self.guider._enabled and not math.isclose(params.guidance_scale or 0.0, neutral)

    def batch_key(self, params: SamplingParams) -> Hashable:
        return (params.width, params.height, params.num_frames, params.image is not None)

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """Image to video: the image's aspect bucket at `target_size`, as the pipeline crops it (it takes no size)."""
        if params.image is None:
            return super()._size(params)
        w, h = image_size(params.image)
        height, width = self.bucket(h, w)
        for name, side, asked in (("width", width, params.width), ("height", height, params.height)):
            if asked is not None and asked != side:
                raise ParamError(name, f"an image to video clip is {width}x{height}, its image's bucket; got {asked}")
        return width, height


@torch.inference_mode()
def cached_forward(
    method: Method, batched: dict[str, Any], shared: dict[str, Any], rows: int, states: Sequence[Any], *, transformer
) -> torch.Tensor:
    """One transformer call (`batched`: its arguments) with a step cache decision per row (`states`: `RowState`s):
    the transformer's own forward, its blocks run by `cached_blocks` (models/stepcache/span.py). The video tokens are
    the cached stream; the text, which the dual-stream blocks change too, is kept for DBCache's last blocks."""
    with spanned(transformer, partial(_cached_blocks, method, states, lora_narrows(transformer))):
        out = transformer(**batched)[0]
    x = batched["hidden_states"][:, : out.shape[1]]  # the noisy latents (the condition's channels follow them)
    return settle(method, out, x, sigmas(states), rows, states)


def _cached_blocks(method: Method, states: Sequence[Any], narrows, blocks, video, text, temb, mask, freqs):
    """The blocks as the forward calls them (positionally: video, text, temb, text mask, rotary angles)."""
    batch = Batch(video, text, temb, 1, states, {"attention_mask": mask}, narrows, {"freqs_cis": freqs})
    return cached_blocks(method, [TextFirst(b) for b in blocks], batch), text  # the text after them: unused


class Hunyuan15AttnProcessor:
    """diffusers' `HunyuanVideo15AttnProcessor2_0` with a key mask: the pipeline masks queries and keys of padded text
    with a [B, 1, L, L] mask built in every block (~12 GB per row at 720p x 121 frames); here a [B, 1, 1, L] one:
    every video and real text token attends to exactly the same keys, and the padded text rows, which no token ever
    reads, are not computed to zero. With `g` (Ulysses) the video tokens are sharded across it: each rank projects,
    normalises and rotates its shard, the text (its own projections) stays whole, and the attention runs over the
    whole [video, text] sequence through the Ulysses all-to-all."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup | None = None) -> None:
        self.g = g

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # [B, S, H, d]

        query, key = attn.norm_q(heads(attn.to_q(hidden_states))), attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query = heads(attn.add_q_proj(encoder_hidden_states))
        text_key = heads(attn.add_k_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        text_value = heads(attn.add_v_proj(encoder_hidden_states))
        text_len = encoder_hidden_states.shape[1]
        video_len = hidden_states.shape[1] if self.g is None else sum(self.g.shards)
        mask = F.pad(attention_mask.bool(), (video_len, 0), value=True)[:, None, None, :]  # [B, 1, 1, S + T]
        q, k, v = (
            torch.cat([x, t], dim=1).transpose(1, 2)
            for x, t in ((query, text_query), (key, text_key), (value, text_value))
        )  # [B, H, S_local + T, d]
        if self.g is None:
            out = attention(q, k, v, self._attention_backend, mask)
        else:
            out = ulysses_sdpa(
                q, k, v, self.g, replicated=text_len, replicated_first=False, backend=self._attention_backend,
                attn_mask=mask,
            )  # fmt: skip
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        video, text = out[:, :-text_len], out[:, -text_len:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text)


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    """A checkpoint saved as `HunyuanVideo15ImageToVideoPipeline`: every request animates its image."""

    spec = specs.HUNYUAN_VIDEO_15_I2V
    requires_image = True
