"""What the video families share: the frame rules in their capabilities and requests (`num_frames` of 1 + k x
`frame_step` frames, played at `fps`), clips as their pipelines' `output_type="np"` gives them, and previews of a
clip's latent frames side by side. A part of a family's adapter class, before `FlowMatchAdapter` (Wan, LTX-2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import torch

from diffusiond.models.base import Capabilities
from diffusiond.models.params import ParamError, SamplingParams


class VideoClips:
    """Provides the video parts of `FlowMatchAdapter`'s hooks; the family sets `frame_step` (pixel frames per
    latent frame) and says how long a clip may be (`_max_frames`)."""

    modality: ClassVar[str]
    family: ClassVar[str]
    image_inputs: ClassVar[tuple[str, ...]]
    default_num_frames: ClassVar[int]
    default_fps: ClassVar[int]
    frame_step: int
    pipe: Any
    latent_rgb: Any
    vae_scale_factor: int

    # A checkpoint whose every request animates an image (saved as an image-to-video pipeline).
    requires_image: ClassVar[bool] = False

    def _max_frames(self) -> int:
        raise NotImplementedError

    def _strength(self, params: SamplingParams) -> float | None:
        """Image to video (where the checkpoint takes a "first-frame"): the image is the clip's first frame at every
        step, so there is no strength. Other images are the flow-matching families' to refuse."""
        if params.image is None and self.requires_image:
            raise ParamError("image", f"the {self.family} family animates an image: send the first frame (image)")
        if params.image is None or "first-frame" not in self.image_inputs:
            return super()._strength(params)  # type: ignore[misc]
        if params.strength is not None:
            raise ParamError("strength", f"the {self.family} family keeps its first frame at every step; drop strength")
        return None

    def _capabilities(self) -> Capabilities:
        return dataclasses.replace(
            super()._capabilities(),  # type: ignore[misc]
            modality=self.modality,
            default_num_frames=min(self.default_num_frames, self._max_frames()),
            max_num_frames=self._max_frames(),
            frame_step=self.frame_step,
            default_fps=self.default_fps,
        )

    def _video(self, params: SamplingParams) -> dict[str, Any]:
        caps = self.capabilities  # type: ignore[attr-defined]
        frames = params.num_frames if params.num_frames is not None else caps.default_num_frames
        assert caps.max_num_frames is not None and caps.frame_step is not None
        if frames > caps.max_num_frames or (frames - 1) % caps.frame_step:
            raise ParamError(
                "num_frames",
                f"num_frames must be 1 + {caps.frame_step}k (1, {1 + caps.frame_step}, {1 + 2 * caps.frame_step}, "
                f"...) up to {caps.max_num_frames} for this model, got {frames}",
            )
        return {"num_frames": frames, "fps": params.fps if params.fps is not None else caps.default_fps}

    def postprocess(self, images: torch.Tensor) -> list[np.ndarray]:
        video = self.pipe.video_processor.postprocess_video(images, output_type="np")  # [B, F, H, W, 3]
        return list(video)

    def preview(self, x0: torch.Tensor) -> np.ndarray:
        """[C, T, h, w] -> the latent frames' fast previews side by side: uint8 [h, T * w, 3]."""
        frames = self.latent_rgb.to_uint8_batch(x0.detach().transpose(0, 1))  # [T, h, w, 3]
        return torch.cat(list(frames), dim=1).cpu().numpy()

    @torch.inference_mode()
    def preview_vae(self, x0: torch.Tensor) -> list[np.ndarray]:
        """[B, C, T, h, w] decoded by the VAE; the frames at latent-frame positions (0, step, 2 step, ...) side by
        side."""
        self._stage("vae")  # type: ignore[attr-defined]
        strips = []
        count = (x0.shape[2] - 1) * self.frame_step + 1  # frames of each clip
        pixels = count * x0.shape[-2] * x0.shape[-1] * self.vae_scale_factor**2
        for video in self.postprocess(self._decode_within(x0, pixels)):  # type: ignore[attr-defined]  # [F, H, W, 3]
            frames = (video[:: self.frame_step] * 255).round().astype(np.uint8)
            strips.append(np.concatenate(list(frames), axis=1))
        return strips
