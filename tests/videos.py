"""Reading video files in tests: an MP4's frames (PyAV) and an animated WebP's (Pillow), as uint8 [F, H, W, 3].

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from videos import ...`.
"""

from __future__ import annotations

import io

import av
import numpy as np
from PIL import Image


def decode_mp4(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])


def decode_webp(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        frames = []
        for i in range(image.n_frames):
            image.seek(i)
            frames.append(np.asarray(image.convert("RGB")))
        return np.stack(frames)
