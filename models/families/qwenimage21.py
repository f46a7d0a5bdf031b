"""Qwen-Image 2.1 (`QwenImage21Pipeline` checkpoints): a Qwen3-VL text encoder (its last layer before the final norm,
the system message's tokens dropped), one single-stream block-causal transformer over [text, image] on unpatched
latents of a 16x VAE that decodes RGBA, and true CFG (`true_cfg_scale` > 1 with a negative prompt; the checkpoint is
meant to be sampled without, hence the default 1.0).

Text to image, and generation conditioned on one to three images (`image`, then `reference_images`): each image,
as RGBA at 1024x1024's area in its own aspect, is read by the text encoder ("<image1>" slots before the prompt) and
encoded by the VAE (latent mode, no draw); its latent tokens precede the noisy ones in every step's sequence, and
the transformer's output for them is dropped. The output's size defaults to the last image's aspect at
1024x1024's area, as the pipeline's. A prompt's encoding depends on its images: the prompt cache keys it by text and
images.

Batching. The transformer lays out every row of a call as its first row (the text's rotary positions run into the
image's frame index, and `img_mask` and `img_shapes` are read from row 0), so a padded shorter prompt would move its
image: a row may share a call only with rows whose text has the same length. Each step groups the batch's rows (a
request's positive and negative rows too) by text length and runs one transformer call per group: requests of one
prompt, `n` > 1 copies, and prompts of equal length share forwards; others run in the same step, in calls of their
own. The pipeline's prefix KV cache (text keys and values computed once, at the first step) is not used: the
prefix is computed again at every step, which gives the same images (measured: equal in fp32) at the cost of the
text's share of each forward.

On several ranks: CFG-parallel (each rank one row of every true-CFG request, or half of a batch's requests without
it), and Ulysses: the target image's tokens are sharded (the text and condition-image prefix stays whole on every
rank, as other families' text does) and each block's block-causal attention runs over the whole sequence for the
rank's heads. LoRA per request in every call. Step caches decide per row (`cached_forward`: a request's rows may
run in calls of different layouts). Not served yet: the other parallel strategies, and
checkpoints that fix their schedule (`sample_sigmas`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

from diffusiond.kernels.attention import attention
from diffusiond.kernels.ulysses import UlyssesGroup, ulysses_sdpa
from diffusiond.models.base import RequestState, UnsupportedLayout
from diffusiond.models.families import specs
from diffusiond.models.families.qwenimage_edit import _ratio, _ratios, images_prompts
from diffusiond.models.flowmatch.adapter import FlowMatchAdapter
from diffusiond.models.flowmatch.prompts import Prompts
from diffusiond.models.flowmatch.requests import RequestRules
from diffusiond.models.flowmatch.sampler import request_generator, shift_mu
from diffusiond.models.inputs import open_rgba
from diffusiond.models.params import ParamError, SamplingParams
from diffusiond.models.stepcache.cache import StepCache
from diffusiond.models.stepcache.forwards import lora_narrows
from diffusiond.models.stepcache.methods import Batch, Method, cached_blocks, settle
from diffusiond.models.stepcache.span import RowState, spanned


class QwenImage21Adapter(FlowMatchAdapter):
    spec = specs.QWEN_IMAGE_21
    # The pipeline's own defaults: 40 steps, no guidance unless asked (true CFG with a negative prompt), 1024x1024.
    default_steps = 40
    default_guidance = 1.0  # no guidance embedding: `guidance_scale` is refused unless left at this
    output_resolution = 1024
    TEXT_ENCODERS = ("text_encoder",)

    def __init__(self, pipe, *, source: str, lazy=None) -> None:
        if pipe.config.get("sample_sigmas") is not None:
            raise UnsupportedLayout("a fixed sampling schedule (`sample_sigmas`) is not served by the family yet")
        super().__init__(pipe, source=source, lazy=lazy)

    def _vae_scale_factor(self, pipe) -> int:
        return pipe.vae_scale_factor  # 16: one latent token per 16x16 pixels, unpatched

    def _default_size(self) -> tuple[int, int]:
        return self.output_resolution, self.output_resolution

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2  # the pipeline floors sides to it

    def _latent_channels(self) -> int:
        return self.vae.config.z_dim

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return Qwen21Requests(caps, declared, output_resolution=self.output_resolution, **parts)

    def _prompts(self) -> Prompts:
        return images_prompts(self._encode, self.requests.uses_cfg)

    # ---- prompts ----

    def _encode(self, keys: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The pipeline's own encoder: each prompt's embeddings without padding [L, D] and which of them are image
        slots [L] (uint8). Prompts without images in one batched call (left-padded, as the pipeline's); a prompt
        with images alone, with them (the pipeline's call reads one set of images)."""
        self._stage(*self.TEXT_ENCODERS)
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with_images = {k: k.partition("\x00") for k in keys if k.partition("\x00")[0] in self.prompts.pending}
        plain = [k for k in keys if k not in with_images]
        if plain:
            out.update(zip(plain, self._encode_with(plain, None), strict=True))
        for key, (digest, _, text) in with_images.items():
            images = [self._condition_image(data) for data in self.prompts.pending[digest]]
            (out[key],) = self._encode_with([text], images)
        return [out[k] for k in keys]

    def _encode_with(self, texts: list[str], images: list[Any] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        embeds, mask, pads = self.pipe.encode_prompt(prompt=texts, image=images, device=self.device)
        lengths = mask.sum(dim=1).tolist() if mask is not None else [embeds.shape[1]] * len(texts)
        # The image slots as uint8, as a group's encode-once broadcast carries them.
        return [(embeds[i, :n].clone(), pads[i, :n].to(torch.uint8)) for i, n in enumerate(lengths)]

    def _condition_image(self, data: bytes) -> Any:
        """A condition image as the pipeline's text encoder reads it: RGBA, resized to its aspect at 1024x1024's
        area."""
        image = open_rgba(data)
        width, height, _ = calculate_dimensions(self.output_resolution**2, image.width / image.height)
        return self.pipe.image_processor.resize(image, width=width, height=height)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # key -> ([L, D], image slots [L])
        channels = self.transformer.config.in_channels
        s = self.vae_scale_factor
        states = []
        for i, (request_id, p) in enumerate(requests):
            embeds, pads = text[self.prompts.key(p.prompt, p)]
            generator = request_generator(p)
            sizes, vae_images = self.requests.context_size(p) or (), None
            if p.image is not None:
                self._stage("vae")
                vae_images = [
                    self.pipe.image_processor.preprocess(open_rgba(data), width=width, height=height).unsqueeze(2)
                    for data, (width, height) in zip((p.image, *(p.reference_images or ())), sizes, strict=True)
                ]
            # The pipeline's own: the images' latent modes (no draw), then the noise from the request's generator.
            latents, context = self.pipe.prepare_latents(
                vae_images, 1, channels, p.height, p.width, embeds.dtype, self.device, generator
            )  # [1, seq, C], [1, ctx, C] or None
            sigmas = np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps)
            sampler = self._sampler(
                p, generator, sigmas=sigmas, mu=shift_mu(self.pipe.scheduler.config, latents.shape[1])
            )
            rows, slots = [embeds], [pads]  # (positive, negative) with true CFG
            cond = {} if context is None else {"context": context}
            if cfg[i]:
                negative, negative_pads = text[self.prompts.key(p.negative_prompt or "", p)]
                rows.append(negative)
                slots.append(negative_pads)
                cond["true_cfg"] = torch.full([1], p.true_cfg_scale, device=self.device, dtype=torch.float32)
            shapes = (*((1, h // s, w // s) for w, h in sizes), (1, p.height // s, p.width // s))
            # Each row's layout (text length and image slots), computed once: rows of one layout share a call.
            shared = {"shapes": shapes, "slots": slots, "layouts": [x.cpu().numpy().tobytes() for x in slots]}
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, shared=shared))
        return states

    @torch.inference_mode()
    def denoise(self, states: Sequence[RequestState]) -> torch.Tensor:
        self._stage("transformer")
        latents = torch.cat([s.latents for s in states]).to(self.transformer.dtype)  # [B, seq, C]
        seq = latents.shape[1]
        if "context" in states[0].cond:  # the condition images' tokens first (one layout per batch key)
            context = torch.cat([s.cond["context"] for s in states]).to(latents.dtype)
            latents = torch.cat([context, latents], dim=1)
        timestep = torch.stack([s.sampler.timestep for s in states]).to(self.device, latents.dtype) / 1000  # [B]
        rows = len(states[0].rows)  # 2 with true CFG (batch key)
        out = self.ranks.members(
            len(states), rows, lambda members: self._predict(states, latents, timestep, seq, members)
        )  # [B, rows, seq, C]
        if rows == 1:
            return out[:, 0]
        scale = torch.cat([s.cond["true_cfg"] for s in states]).to(out.dtype).view(-1, 1, 1)
        pos, neg = out[:, 0], out[:, 1]
        return neg + scale * (pos - neg)

    def _predict(self, states, latents, timestep, seq: int, members: list[tuple[int, int]]) -> torch.Tensor:
        """The transformer's output for the image tokens of `members` ((request, row) pairs), [len, seq, C] in
        their order: rows whose texts have one layout (length and image slots) share a call."""
        groups: dict[bytes, list[int]] = {}
        for k, (i, r) in enumerate(members):
            groups.setdefault(states[i].shared["layouts"][r], []).append(k)
        out = latents.new_empty(len(members), seq, latents.shape[2])
        shapes = list(states[0].shared["shapes"])  # one size and set of image sizes per batch (batch key)
        for ks in groups.values():
            first, row = members[ks[0]]
            # The text's slots, then one image slot per 2x2 latent tokens of the output.
            slots = states[first].shared["slots"][row].bool()
            img_mask = torch.cat([slots, slots.new_ones(seq // 4)]).expand(len(ks), -1)
            index = torch.tensor([members[k][0] for k in ks], device=self.device)
            batched = {
                "hidden_states": latents[index],
                "timestep": timestep[index],
                "encoder_hidden_states": torch.stack([states[i].rows[r] for i, r in (members[k] for k in ks)]),
            }
            # A step cache's rows: each its own (a request's rows may run in calls of different layouts).
            row_states = [RowState(states[i], r, r == 0) for i, r in (members[k] for k in ks)]
            with self.loras.rows([self.loras.of(states[members[k][0]]) for k in ks]):
                shared = {"img_shapes": [shapes] * len(ks), "img_mask": img_mask}
                pred = self.cache.forward(batched, shared, 1, row_states)[:, -seq:]
            out[torch.tensor(ks, device=self.device)] = pred
        return out

    def _step_cache(self) -> StepCache:
        cached = partial(cached_forward, transformer=self.transformer)
        return StepCache(self.family, self.cache_methods, self._call, cached)

    def enable_ulysses(self, group: UlyssesGroup) -> None:
        """The target image's tokens (the joint sequence's suffix) sharded across `group` from the first block on,
        with their rotary angles and modulation rows; the prefix (text and condition images) stays whole on every
        rank; the last block's output is gathered."""
        self.ranks.ulysses = group
        blocks = self.transformer.transformer_blocks
        span: dict[str, int] = {}

        def local(x: torch.Tensor, dim: int) -> torch.Tensor:  # the prefix and this rank's part of the target
            prefix, start, stop = span["prefix"], span["start"], span["stop"]
            whole = x.narrow(dim, 0, prefix)
            return torch.cat([whole, x.narrow(dim, prefix + start, stop - start)], dim=dim)

        def shard(module, args, kwargs):
            kwargs = dict(kwargs)
            if module is blocks[0]:
                segments = kwargs["segments"]
                span["prefix"] = group.text_len = segments[-1][1] if segments else 0
                span["start"], span["stop"] = group.split(kwargs["hidden_states"].shape[1] - span["prefix"])
                kwargs["hidden_states"] = local(kwargs["hidden_states"], 1)
            kwargs["rotary_emb"] = local(kwargs["rotary_emb"], 0)
            if kwargs.get("target_token_mask") is not None:  # `causal_condition`: the prefix modulates from t = 0
                kwargs["target_token_mask"] = local(kwargs["target_token_mask"], 0)
            return args, kwargs

        def gather(module, args, output):
            prefix = span["prefix"]
            return torch.cat([output[:, :prefix], group.gather_seq(output[:, prefix:])], dim=1)

        for block in blocks:
            block.attn.set_processor(UlyssesQwen21AttnProcessor(group))
            block.register_forward_pre_hook(shard, with_kwargs=True)
        blocks[-1].register_forward_hook(gather)

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        # [B, seq, C] -> [B, C, 1, h, w] -> one frame [B, C, h, w]
        return QwenImage21Pipeline._unpack_latents(latents, params.height, params.width, self.vae_scale_factor)[:, :, 0]

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> the VAE's RGBA output [B, 4, H, W], the pipeline's de-normalisation step for step."""
        latents = latents.unsqueeze(2).to(self.vae.dtype)  # the video VAE's one frame
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return self.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]


class Qwen21Requests(RequestRules):
    """`output_resolution`: the side of the square whose area condition images and default sizes take."""

    # Condition images: the first and up to this many more.
    max_references: ClassVar[int] = 2

    def __init__(self, caps: Any, declared: Any, *, output_resolution: int, **parts: Any) -> None:
        super().__init__(caps, declared, **parts)
        self.output_resolution = output_resolution

    def uses_cfg(self, params: SamplingParams) -> bool:
        # As the pipeline's `do_true_cfg`.
        return (params.true_cfg_scale or 0.0) > 1 and params.negative_prompt is not None

    def _references(self, params: SamplingParams) -> tuple[bytes, ...] | None:
        references = super()._references(params)
        if references is not None and len(references) > self.max_references:
            raise ParamError(
                "reference_images",
                f"the {self.family} family conditions on at most {self.max_references + 1} images, "
                f"got {len(references) + 1}",
            )
        return references

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """Unsent sides: the last image's aspect at 1024x1024's area, as the pipeline's default."""
        if params.width is not None or params.height is not None or params.image is None:
            return super()._size(params)
        last = (params.reference_images or (params.image,))[-1]
        width, height, _ = calculate_dimensions(self.output_resolution**2, _ratio(last, "image"))
        m = self.caps.size_multiple
        return width // m * m, height // m * m

    def context_size(self, params: SamplingParams) -> tuple[tuple[int, int], ...] | None:
        """(width, height) each condition image is read and encoded at: its aspect at 1024x1024's area."""
        if params.image is None:
            return None
        return tuple(calculate_dimensions(self.output_resolution**2, ratio)[:2] for ratio in _ratios(params))


class UlyssesQwen21AttnProcessor:
    """diffusers' `QwenImage21AttnProcessor` (the prefill path: no KV cache) over a sequence whose target-image
    suffix is sharded across `g`: each rank projects, normalises and rotates its tokens, and the block-causal
    attention (each prefix segment over the keys up to its end, text segments causal within themselves, the target
    over every key; padded text keys dropped) runs over the whole sequence for the rank's heads."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, g: UlyssesGroup) -> None:
        self.g = g

    def __call__(
        self,
        attn,
        hidden_states,
        attention_mask=None,
        rotary_emb=None,
        layer_cache=None,
        kv_cache_mode=None,
        cache_write_slice=None,
        segments=None,
        key_valid=None,
    ):
        from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prepare_qkv

        if layer_cache is not None or segments is None:
            raise ValueError("Qwen-Image 2.1 under Ulysses runs without its prefix KV cache and flex attention")
        query, key, value, _ = _qwenimage21_prepare_qkv(attn, hidden_states, rotary_emb, None, None, None)
        prefix = segments[-1][1] if segments else 0
        # SDPA, as the stock processor (its causal triangles are masks no varlen kernel takes).
        backend = None

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [B, H/N, P + S, d]
            outputs = []
            for start, end, is_text in segments:
                mask = None
                if is_text:  # everything before the segment, and a causal triangle over its own keys
                    ones = torch.ones(end - start, end, dtype=torch.bool, device=q.device)
                    mask = torch.cat([ones[:, :start], torch.tril(ones[:, start:])], dim=1)[None, None]
                if key_valid is not None:
                    valid = key_valid[:, None, None, :end]
                    mask = valid if mask is None else mask & valid
                outputs.append(attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], backend, mask))
            valid = None if key_valid is None else key_valid[:, None, None, :]
            outputs.append(attention(q[:, :, prefix:], k, v, backend, valid))
            return torch.cat(outputs, dim=2)

        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, P + S_local, d]
        out = ulysses_sdpa(q, k, v, self.g, replicated=prefix, replicated_first=True, attend=attend)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@torch.inference_mode()
def cached_forward(
    method: Method, batched: dict[str, Any], shared: dict[str, Any], rows: int, states: Sequence[Any], *, transformer
) -> torch.Tensor:
    """One transformer call with a step cache decision per row (`states`: `RowState`s): the transformer's own forward
    around a span of its blocks (models/stepcache/span.py). The cached stream is the whole joint sequence (text,
    condition images and target: its one stream changes them all); the output, the target image's tokens."""
    with spanned(transformer, partial(_cached_blocks, method, states, lora_narrows(transformer))):
        out = transformer(**batched, **shared, return_dict=False)[0]
    seq = math.prod(shared["img_shapes"][0][-1])  # the target's tokens, last in the joint sequence
    x = batched["hidden_states"][:, -seq:]
    return settle(method, out[:, -seq:], x, batched["timestep"], rows, states)  # its timestep: sigma


def _cached_blocks(method: Method, states: Sequence[Any], narrows, blocks, *, hidden_states, modulation, **kwargs):
    """The blocks over the joint sequence. Their modulation has a row per call row and, with `causal_condition`, a
    last one (t = 0) every row reads: a sub-batch takes its rows' and that one (`_Rows`)."""
    count = hidden_states.shape[0]
    ids = torch.arange(count, device=hidden_states.device)  # as `temb`: each sub-batch's rows
    rows = {"key_valid": kwargs.pop("key_valid")}
    kwargs["modulation"] = modulation
    joints = [_Rows(block, modulation.shape[0] > count) for block in blocks]
    context = hidden_states.new_zeros(count, 0, hidden_states.shape[2])  # no separate text: one stream
    batch = Batch(hidden_states, context, ids, 1, states, rows, narrows, kwargs, context=True)
    return cached_blocks(method, joints, batch)


class _Rows:
    """A Qwen-Image 2.1 block as `cached_blocks` calls blocks, over a sub-batch (`temb`: its rows' indices)."""

    def __init__(self, block: Any, shared_row: bool) -> None:
        self.block, self.shared_row = block, shared_row

    def __call__(self, hidden_states, encoder_hidden_states, temb, modulation, **kwargs):
        mine = modulation[temb]
        if self.shared_row:
            mine = torch.cat([mine, modulation[-1:]])
        return encoder_hidden_states, self.block(hidden_states=hidden_states, modulation=mine, **kwargs)
