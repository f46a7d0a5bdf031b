"""A video family's clip (float32 [F, H, W, 3] in [0, 1]) -> a file: MP4 (H.264, yuv420p) through PyAV, whose wheels
ship FFmpeg with libx264, or lossless animated WebP through PIL, asked for or when no H.264 encoder is available.

numpy, PIL and PyAV only, never torch: this runs in the encoder pool (`image_encoding.encoder_pool`), off the event
loop.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from diffusiond.daemon.image_encoding import to_uint8

log = logging.getLogger(__name__)

VIDEO_FORMATS = ("mp4", "webp")
MEDIA_TYPES = {"mp4": "video/mp4", "webp": "image/webp"}
# x264's constant quality (18: visually lossless for most content) and speed. Measured on 2 cores, 33 noisy frames
# at 832x480: "medium" 90 ms/frame, "veryfast" 25 ms/frame, for files 9% larger.
CRF = "18"
PRESET = "veryfast"
# One x264 thread per encode: the encoder pool's threads share the CPU with the step thread's torch threads
# (image_encoding.encoder_pool); two threads gained 0-25% per encode.
X264_THREADS = 1


@dataclass(frozen=True)
class EncodedVideo:
    data: bytes
    format: str
    # The file's frame size: the clip's, or one more row or column where a side was odd (yuv420p needs even sides).
    width: int
    height: int
    num_frames: int
    fps: int
    # Why the file is not the MP4 that was asked for (no H.264 encoder here); None when it is what was asked for.
    fallback: str | None = None

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.format]


@functools.cache
def h264_unavailable() -> str | None:
    """Why this process cannot write H.264, or None when it can. Found out once (by encoding two tiny frames, in the
    encoder pool: at the first video), and logged then."""
    reason = None
    try:
        import av
    except ImportError:
        reason = "PyAV is not installed (pip install 'diffusiond[video]')"
    else:
        try:
            _encode_mp4(np.zeros((2, 16, 16, 3), np.float32), 1, None)
        except (av.FFmpegError, ValueError) as exc:
            reason = f"this PyAV build cannot encode H.264 with libx264 ({exc})"
    if reason is not None:
        log.warning("videos are written as animated WebP, not MP4: %s", reason)
    return reason


def encode_video(frames: np.ndarray, fps: int, fmt: str = "mp4", scratch: Path | None = None) -> EncodedVideo:
    """frames: [F, H, W, 3], float in [0, 1] (or uint8). "mp4" falls back to "webp" where H.264 is unavailable;
    the result says so in `fallback`. `scratch`: the folder of the MP4's staging file (the video store's, so that
    it is counted on that disk, not on a small /tmp); default: the system's temporary folder."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"a clip is [frames, height, width, 3]; got shape {frames.shape}")
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"video format must be one of {', '.join(VIDEO_FORMATS)}; got {fmt!r}")
    fallback = None
    if fmt == "mp4" and (fallback := h264_unavailable()) is not None:
        fmt = "webp"
    num_frames, height, width = frames.shape[:3]
    if fmt == "mp4":
        data, width, height = _mp4_bytes(frames, fps, scratch)
    else:
        data = _encode_webp(frames, fps)
    return EncodedVideo(data, fmt, width, height, num_frames, fps, fallback)


def _mp4_bytes(frames: np.ndarray, fps: int, scratch: Path | None = None) -> tuple[bytes, int, int]:
    """MP4 with its index first (`+faststart`: plays while it downloads), which FFmpeg writes only to a file it can
    reopen: written to a temporary file and read back."""
    fd, path = tempfile.mkstemp(prefix="diffusiond-", suffix=".mp4", dir=scratch)
    os.close(fd)
    try:
        width, height = _encode_mp4(frames, fps, path)
        with open(path, "rb") as f:
            return f.read(), width, height
    finally:
        os.unlink(path)


def _encode_mp4(frames: np.ndarray, fps: int, path: str | None) -> tuple[int, int]:
    import av

    height, width = frames.shape[1:3]
    # yuv420p halves both chroma sides: an odd side gets its last row or column repeated.
    pad = ((0, height % 2), (0, width % 2), (0, 0))
    out = path if path is not None else io.BytesIO()
    options = {"movflags": "+faststart"} if path is not None else {}
    with av.open(out, mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": CRF, "preset": PRESET}
        stream.codec_context.thread_count = X264_THREADS
        for frame in frames:
            rgb = to_uint8(frame)
            if any(p[1] for p in pad):
                rgb = np.pad(rgb, pad, mode="edge")
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")))
        container.mux(stream.encode())
    return stream.width, stream.height


def _encode_webp(frames: np.ndarray, fps: int) -> bytes:
    """Lossless animated WebP: the exact frames. libwebp stores a frame identical to the one before it once, with
    the summed duration (the timeline is unchanged; a decoder then counts fewer frames)."""
    images = [Image.fromarray(to_uint8(frame)) for frame in frames]
    buf = io.BytesIO()
    duration = max(1, round(1000 / fps))
    images[0].save(
        buf, format="WEBP", save_all=True, append_images=images[1:], duration=duration, loop=0, lossless=True
    )
    return buf.getvalue()
