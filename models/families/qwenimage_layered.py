"""Qwen-Image-Layered (`QwenImageLayeredPipeline` checkpoints): an image decomposed into `layers` RGBA layers.

The image (RGBA where the VAE reads four channels) is encoded by the VAE (latent mode: no draw) and joins every
step's sequence after the noisy latents, whose `layers + 1` frames are the composite and each layer; the transformer
places them with its per-layer rotary positions (`img_shapes`: one entry per frame, then the image's) and adds its
RGB/RGBA embedding to the timestep's (`additional_t_cond`, 0 as the pipeline's call). Its output for the image's
tokens is dropped. The prompt is read alone, as Qwen-Image's. At the end every layer but the composite is decoded:
a request's answer is `layers` RGBA images ([layers, H, W, 4]), as the call returns them.

The call takes no size: the image's aspect at `resolution`² (640 or 1024), which is the default here; a request's
`width` and `height` stand in for that size everywhere the call reads it (the image's, the output's). The call's own
switches come by name in `arguments`: `layers` (4), `resolution` (640), `cfg_normalize` (false: plain true CFG; true:
rescaled to the conditional prediction's norm, as Qwen-Image always does). A prompt is required: the call's caption
of an image sent without one (its text encoder generating up to 512 tokens) is not served.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import QwenImageLayeredPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_layered import calculate_dimensions

from diffusiond.models.base import RequestState
from diffusiond.models.families import specs
from diffusiond.models.families.qwenimage import QwenImageAdapter
from diffusiond.models.families.qwenimage_edit import QwenEditRequests
from diffusiond.models.flowmatch.requests import RequestRules, output_sized_context
from diffusiond.models.flowmatch.sampler import request_generator
from diffusiond.models.inputs import image_size, open_rgb, open_rgba
from diffusiond.models.params import ParamError, SamplingParams

# The call's `calculate_dimensions` buckets; its default is the first.
RESOLUTIONS = (640, 1024)
# The call's default; at most as many as a request may ask (each layer is a frame of every step's sequence).
DEFAULT_LAYERS, MAX_LAYERS = 4, 16


class QwenImageLayeredAdapter(QwenImageAdapter):
    spec = specs.QWEN_IMAGE_LAYERED

    def _request_rules(self, caps: Any, declared: Any, **parts: Any) -> RequestRules:
        return LayeredRequests(caps, declared, **parts)

    def _default_size(self) -> tuple[int, int]:
        return RESOLUTIONS[0], RESOLUTIONS[0]  # a square image at the default bucket

    def _input_image(self, data: bytes, width: int, height: int) -> torch.Tensor:
        """[1, C, 1, H, W] in [-1, 1], as the call preprocesses it: RGBA where the VAE reads four channels."""
        rgba = getattr(self.vae.config, "input_channels", 3) == 4
        image = self.pipe.image_processor.resize((open_rgba if rgba else open_rgb)(data), height, width)
        return self.pipe.image_processor.preprocess(image, height, width).unsqueeze(2)

    @torch.inference_mode()
    def prepare(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[RequestState]:
        params = [p for _, p in requests]
        cfg, text = self.prompts.lookup(params)  # text -> ([L, D],)
        channels = self.transformer.config.in_channels // 4
        s = self.vae_scale_factor
        states = []
        for i, (request_id, p) in enumerate(requests):
            embeds = text[p.prompt][0]
            layers = layer_count(p)
            self._stage("vae")
            image = self._input_image(p.image, p.width, p.height).to(self.device, embeds.dtype)
            generator = request_generator(p)
            # The pipeline's own: the image's latent mode (no draw), then the noise of every frame from the generator.
            latents, context = self.pipe.prepare_latents(
                image, 1, channels, p.height, p.width, layers, embeds.dtype, self.device, generator
            )  # [1, (layers + 1) * seq, C * 4], [1, seq, C * 4]
            sigmas = np.linspace(1.0, 0, p.num_inference_steps + 1)[:-1]
            # The call's shift: from the image's tokens, not the noise's.
            sampler = self._sampler(p, generator, sigmas=sigmas, mu=(context.shape[1] / 256) ** 0.5)
            rows = [embeds]
            cond: dict[str, Any] = {"context": context}
            if cfg[i]:
                rows.append(text[p.negative_prompt or ""][0])
                cond["true_cfg"] = torch.full([1], p.true_cfg_scale, device=self.device, dtype=torch.float32)
                # Plain true CFG unless the request asks the call's normalization (QwenImageAdapter._true_cfg).
                cond["renorm"] = torch.full([1], float(p.arguments["cfg_normalize"]), device=self.device)
            frame = (1, p.height // s // 2, p.width // s // 2)
            shared = {"img_shapes": [[frame] * (layers + 1) + [frame]]}  # one per batch key
            states.append(RequestState(request_id, p, latents, sampler, cond=cond, rows=rows, shared=shared))
        return states

    def _unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The composite frame [B, C, h, w]: what previews show."""
        return self._frames(latents, params)[:, :, 0]

    def _frames(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[B, (layers + 1) * seq, C * 4] -> [B, C, layers + 1, h, w]: the composite, then each layer."""
        return QwenImageLayeredPipeline._unpack_latents(
            latents, params.height, params.width, layer_count(params), self.vae_scale_factor
        )

    @torch.inference_mode()
    def decode_latents(self, states: Sequence[RequestState]) -> torch.Tensor:
        """Every layer but the composite, each decoded alone as the call decodes them: [B, C, layers, H, W] (one
        row per request; C is the VAE's: 4 for RGBA)."""
        self._stage("vae")
        p = states[0].params  # one batch key: one size, one layer count
        frames = self._frames(torch.cat([s.latents for s in states]), p)[:, :, 1:]  # [B, C, layers, h, w]
        b, c, n, h, w = frames.shape
        flat = frames.permute(0, 2, 1, 3, 4).reshape(b * n, c, h, w)
        images = self._decode_within(flat, p.width * p.height)  # [B * layers, C, H, W]
        return images.unflatten(0, (b, n)).transpose(1, 2)

    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        """Layers [B, C, layers, H, W] -> float32 [layers, H, W, C] per request; a preview's [B, C, H, W] as any
        image's."""
        if images.ndim == 4:
            return super().postprocess(images)
        process = self.pipe.image_processor.postprocess
        return [process(layers.transpose(0, 1), output_type="np") for layers in images]


class LayeredRequests(QwenEditRequests):
    call_arguments: ClassVar[dict[str, tuple[type, Any, tuple[float, float] | None]]] = {
        "layers": (float, float(DEFAULT_LAYERS), (1, MAX_LAYERS)),
        "resolution": (float, float(RESOLUTIONS[0]), (RESOLUTIONS[0], RESOLUTIONS[-1])),
        "cfg_normalize": (bool, False, None),
    }

    def _call_arguments(self, params: SamplingParams) -> dict[str, Any] | None:
        arguments = super()._call_arguments(params)
        assert arguments is not None
        for name in ("layers", "resolution"):
            if not float(arguments[name]).is_integer():
                raise ParamError("arguments", f"argument {name!r} must be a whole number, got {arguments[name]}")
            arguments[name] = int(arguments[name])
        if arguments["resolution"] not in RESOLUTIONS:
            raise ParamError(
                "arguments", f"argument 'resolution' must be one of {RESOLUTIONS}, got {arguments['resolution']}"
            )
        return arguments

    def _size(self, params: SamplingParams) -> tuple[int, int]:
        """Unsent sides: the image's aspect at `resolution`², as the call sizes its output."""
        if params.width is not None or params.height is not None or params.image is None:
            return super()._size(params)
        width, height = image_size(params.image)
        side = int((params.arguments or {}).get("resolution", RESOLUTIONS[0]))
        return calculate_dimensions(side * side, width / height)

    def context_size(self, params: SamplingParams) -> tuple[int | None, int | None] | None:
        return output_sized_context(params)  # the image is read and encoded at the output's size

    def batch_key(self, params: SamplingParams) -> Hashable:
        # Every frame of every layer is in the sequence: requests batch with those of as many layers.
        return (*super().batch_key(params), layer_count(params))


def layer_count(params: SamplingParams) -> int:
    return int((params.arguments or {}).get("layers", DEFAULT_LAYERS))
