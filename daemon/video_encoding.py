"""A video family's clip (float32 [F, H, W, 3] in [0, 1]) -> a file: MP4 (H.264, yuv420p, and AAC when the clip has
sound) through PyAV, whose wheels ship FFmpeg with libx264, or lossless animated WebP through PIL (silent), asked
for or when no H.264 encoder is available.

numpy, PIL and PyAV only, never torch: this runs in the encoder pool (`image_encoding.encoder_pool`), off the event
loop.
"""

from __future__ import annotations

import fractions
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
from diffusiond.engine.outputs import Sound

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
# AAC (FFmpeg's own encoder) per channel. Measured on the tiny LTX-2's noise-like waveform at 24 kHz: 18 dB SNR at
# 128 kbit/s per channel after decoding; a tone, 30 dB.
AAC_BITRATE_PER_CHANNEL = 128_000
LAYOUTS = {1: "mono", 2: "stereo"}


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
    # The sound track's samples per second; None: the file is silent (a silent clip, or WebP, which has no sound).
    sample_rate: int | None = None

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


def encode_video(
    frames: np.ndarray, fps: int, fmt: str = "mp4", scratch: Path | None = None, audio: Sound | None = None
) -> EncodedVideo:
    """frames: [F, H, W, 3], float in [0, 1] (or uint8). "mp4" falls back to "webp" where H.264 is unavailable;
    the result says so in `fallback`. `scratch`: the folder of the MP4's staging file (the video store's, so that
    it is counted on that disk, not on a small /tmp); default: the system's temporary folder. `audio`: the clip's
    sound, muxed as AAC into an MP4 (a WebP stays silent)."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"a clip is [frames, height, width, 3]; got shape {frames.shape}")
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"video format must be one of {', '.join(VIDEO_FORMATS)}; got {fmt!r}")
    fallback = None
    if fmt == "mp4" and (fallback := h264_unavailable()) is not None:
        fmt = "webp"
    num_frames, height, width = frames.shape[:3]
    if audio is not None and (audio.samples.ndim != 2 or audio.samples.shape[0] not in LAYOUTS):
        raise ValueError(f"a sound track is [1 or 2 channels, samples]; got shape {audio.samples.shape}")
    sample_rate = None
    if fmt == "mp4":
        data, width, height = _mp4_bytes(frames, fps, scratch, audio)
        sample_rate = audio.sample_rate if audio is not None else None
    else:
        data = _encode_webp(frames, fps)
    return EncodedVideo(data, fmt, width, height, num_frames, fps, fallback, sample_rate)


def _mp4_bytes(
    frames: np.ndarray, fps: int, scratch: Path | None = None, audio: Sound | None = None
) -> tuple[bytes, int, int]:
    """MP4 with its index first (`+faststart`: plays while it downloads), which FFmpeg writes only to a file it can
    reopen: written to a temporary file and read back."""
    fd, path = tempfile.mkstemp(prefix="diffusiond-", suffix=".mp4", dir=scratch)
    os.close(fd)
    try:
        width, height = _encode_mp4(frames, fps, path, audio)
        with open(path, "rb") as f:
            return f.read(), width, height
    finally:
        os.unlink(path)


def _encode_mp4(frames: np.ndarray, fps: int, path: str | None, audio: Sound | None = None) -> tuple[int, int]:
    import av

    height, width = frames.shape[1:3]
    # yuv420p halves both chroma sides: an odd side gets its last row or column repeated.
    pad = ((0, height % 2), (0, width % 2), (0, 0))
    out = path if path is not None else io.BytesIO()
    options = {"movflags": "+faststart"} if path is not None else {}
    with av.open(out, mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = size = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": CRF, "preset": PRESET}
        stream.codec_context.thread_count = X264_THREADS
        sound = _aac_stream(container, audio) if audio is not None else None  # every stream before the first packet
        for frame in frames:
            rgb = to_uint8(frame)
            if any(p[1] for p in pad):
                rgb = np.pad(rgb, pad, mode="edge")
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")))
        container.mux(stream.encode())
        if sound is not None and audio is not None:
            _mux_aac(container, sound, audio)
    return size  # (PyAV 18.1.1 refuses a closed container's stream's attributes)


def _aac_stream(container, audio: Sound):
    stream = container.add_stream("aac", rate=audio.sample_rate)
    stream.layout = LAYOUTS[audio.samples.shape[0]]
    stream.bit_rate = AAC_BITRATE_PER_CHANNEL * audio.samples.shape[0]
    return stream


def _mux_aac(container, stream, audio: Sound) -> None:
    """The waveform as the AAC stream. Its first frame's timestamp is set (0), so that FFmpeg writes an edit list
    skipping the encoder's priming samples: decoders then return the waveform from its first sample."""
    import av

    samples = np.ascontiguousarray(np.clip(audio.samples, -1.0, 1.0), dtype=np.float32)  # [channels, n]
    frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=stream.layout.name)
    frame.sample_rate = audio.sample_rate
    frame.pts, frame.time_base = 0, fractions.Fraction(1, audio.sample_rate)
    container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


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
