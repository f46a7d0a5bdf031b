"""Wan image-to-video (`WanImageToVideoPipeline` checkpoints): the first frame is given. Its VAE latents (with a mask
of the given frames) join the noise as extra input channels at every step; Wan 2.1 I2V's transformer also attends
to its CLIP image embedding, a second context of every block, whose projections are reused like the text's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusiond.models.base import RequestState, UnsupportedLayout
from diffusiond.models.families import specs
from diffusiond.models.families.wan.adapter import WanAdapter
from diffusiond.models.families.wan.attention import project_image
from diffusiond.models.families.wan.projections import tensor_digest, weights_version
from diffusiond.models.inputs import open_rgb


class WanI2VAdapter(WanAdapter):
    """Image-to-video: the first frame is given. Its VAE latents (with a mask of the given frames) join the noise
    as extra input channels at every step, and its CLIP image embedding is a second context for every block."""

    spec = specs.WAN_I2V
    requires_image = True

    def __init__(self, pipe: Any, *, source: str, lazy: Any = None) -> None:
        config = pipe.transformer.config
        if config.image_dim is not None and config.added_kv_proj_dim is None:
            # The pipeline runs it (its image embedding joins the text context); this family reuses per-block image
            # projections it does not have.
            raise UnsupportedLayout(
                "its transformer has an image embedding (`image_dim`) but no image key/value projections "
                "(`added_kv_proj_dim` null), which the wan-i2v family does not read"
            )
        super().__init__(pipe, source=source, lazy=lazy)
        # Wan 2.1 I2V's transformer attends to the first frame's CLIP embedding too; Wan 2.2's (`image_dim` null, no
        # image encoder) sees the image through its latents only, as the pipeline decides.
        self.image_context = self.transformer.config.image_dim is not None
        if self.image_context and len(self.experts) > 1:  # image projections are reused for `transformer` only
            raise ValueError(f"{source}: two experts with image cross-attention is not a layout Wan ships")

    def _prepare_image(self, state: RequestState, rows: int) -> None:
        """As WanImageToVideoPipeline: the image resized to the clip's size, encoded by the VAE (its mode, no
        noise drawn), concatenated after a zero video and masked; and its CLIP embedding."""
        p = state.params
        image = open_rgb(p.image)
        if self.image_context:
            self._stage("image_encoder")
            embeds = self.pipe.encode_image(image, self.device).to(self.dtype)  # [1, 257, D_img]
            state.cond["image_embeds"] = embeds.expand(rows, -1, -1)
            # One for the request's rows; none with LoRA (see `prepare`).
            state.shared["image_entry"] = None if state.params.lora else self._acquire_image(embeds)
        self._stage("vae")
        pixels = self.pipe.video_processor.preprocess(image, height=p.height, width=p.width)
        pixels = pixels.to(self.device, torch.float32)
        _, condition = self.pipe.prepare_latents(
            pixels, 1, self.vae.config.z_dim, p.height, p.width, p.num_frames, torch.float32, self.device,
            None, state.latents,
        )  # fmt: skip
        state.cond["condition"] = condition  # [1, 4 + C, T, h, w]

    def _acquire_image(self, embeds: torch.Tensor) -> Any:
        if self.projections is None:
            return None
        embedder = self.transformer.condition_embedder.image_embedder
        attns = [b.attn2 for b in self.transformer.blocks]
        modules = [m for a in attns for m in (a.add_k_proj, a.add_v_proj, a.norm_added_k)]
        weights = [*embedder.parameters(), *(p for m in modules for p in m.parameters())]
        key = ("image", tensor_digest(embeds), weights_version(weights))

        def compute() -> tuple[torch.Tensor, ...]:
            ctx = embedder(embeds)  # [1, 257, D]
            return tuple(t for a in attns for t in project_image(a, ctx))

        return self.projections.acquire(key, compute)

    def _batched_rows(self, states: Sequence[RequestState]) -> dict[str, Any]:
        rows = super()._batched_rows(states)
        if self.image_context:
            rows["image_entries"] = [s.shared["image_entry"] for s in states for _ in range(len(s.rows))]
        return rows

    def _image_inputs(self, cond: dict[str, Any], rows: int) -> dict[str, Any]:
        if not self.image_context:
            return {}
        return {"encoder_hidden_states_image": cond["image_embeds"], "image_entries": cond["image_entries"]}
