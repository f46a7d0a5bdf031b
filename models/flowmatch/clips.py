"""What the video families share: the frame rules in their capabilities and requests (`num_frames` of 1 + k x
`frame_step` frames, played at `fps`), clips as their pipelines' `output_type="np"` gives them, and previews of a
clip's latent frames side by side. A video family's adapter holds one (`FlowMatchAdapter.clips`; Wan, LTX-2,
HunyuanVideo-1.5); its request rules read the frame rules from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from diffusiond.models.base import Capabilities
from diffusiond.models.params import ParamError, SamplingParams


class VideoClips:
    """`frame_step`: pixel frames per latent frame; `max_frames`: the longest clip the model makes; the defaults are
    its pipeline's; `requires_image`: a checkpoint whose every request animates an image (saved as an image-to-video
    pipeline); `processor`: the pipeline's video processor; `latent_rgb`: the fast latent -> RGB map."""

    def __init__(
        self,
        *,
        frame_step: int,
        max_frames: int,
        default_num_frames: int,
        default_fps: int,
        processor: Any,
        latent_rgb: Any,
        requires_image: bool = False,
    ) -> None:
        self.frame_step, self.max_frames = frame_step, max_frames
        self.default_num_frames, self.default_fps = default_num_frames, default_fps
        self.processor, self.latent_rgb = processor, latent_rgb
        self.requires_image = requires_image

    def capabilities(self, caps: Capabilities) -> Capabilities:
        """`caps` with the clip rules."""
        return dataclasses.replace(
            caps,
            modality="video",
            default_num_frames=min(self.default_num_frames, self.max_frames),
            max_num_frames=self.max_frames,
            frame_step=self.frame_step,
            default_fps=self.default_fps,
        )

    def fields(self, caps: Capabilities, params: SamplingParams) -> dict[str, Any]:
        """The resolved `num_frames` and `fps`."""
        frames = params.num_frames if params.num_frames is not None else caps.default_num_frames
        assert caps.max_num_frames is not None and caps.frame_step is not None
        if frames > caps.max_num_frames or (frames - 1) % caps.frame_step:
            raise ParamError(
                "num_frames",
                f"num_frames must be 1 + {caps.frame_step}k (1, {1 + caps.frame_step}, {1 + 2 * caps.frame_step}, "
                f"...) up to {caps.max_num_frames} for this model, got {frames}",
            )
        return {"num_frames": frames, "fps": params.fps if params.fps is not None else caps.default_fps}

    def postprocess(self, videos: torch.Tensor) -> list[np.ndarray]:
        """The VAE's clips [B, 3, F, H, W] -> float32 [F, H, W, 3] in [0, 1] each."""
        return list(self.processor.postprocess_video(videos, output_type="np"))  # [B, F, H, W, 3]

    def preview(self, x0: torch.Tensor) -> np.ndarray:
        """[C, T, h, w] -> the latent frames' fast previews side by side: uint8 [h, T * w, 3]."""
        frames = self.latent_rgb.to_uint8_batch(x0.detach().transpose(0, 1))  # [T, h, w, 3]
        return torch.cat(list(frames), dim=1).cpu().numpy()

    def pixels(self, x0: torch.Tensor, scale: int) -> int:
        """Output pixels x frames of each clip of latents [B, C, T, h, w] (`scale`: pixels per latent side)."""
        count = (x0.shape[2] - 1) * self.frame_step + 1
        return count * x0.shape[-2] * x0.shape[-1] * scale**2

    def strips(self, videos: list[np.ndarray]) -> list[np.ndarray]:
        """Decoded clips [F, H, W, 3] -> the frames at latent-frame positions (0, step, 2 step, ...) side by side,
        uint8."""
        strips = []
        for video in videos:
            frames = (video[:: self.frame_step] * 255).round().astype(np.uint8)
            strips.append(np.concatenate(list(frames), axis=1))
        return strips
