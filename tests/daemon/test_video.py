"""Clips to files (daemon/video_encoding.py): MP4 that decodes back to the same frames, frame count, size and rate;
odd sides padded; lossless animated WebP, asked for or as the fallback when H.264 is unavailable."""

from __future__ import annotations

import io
import sys

import av
import numpy as np
import pytest
from PIL import Image

from diffusiond.daemon import video_encoding as video
from diffusiond.daemon.video_encoding import encode_video, h264_unavailable


def moving_clip(frames: int, height: int, width: int) -> np.ndarray:
    """Smooth content (what x264 keeps well) that differs from frame to frame: a bright square moving right over a
    gradient. float32 [F, H, W, 3] in [0, 1]."""
    y, x = np.mgrid[0:height, 0:width]
    clip = np.empty((frames, height, width, 3), np.float32)
    for f in range(frames):
        clip[f, ..., 0] = x / width
        clip[f, ..., 1] = y / height
        clip[f, ..., 2] = 0.2
        left = 2 + 3 * f
        clip[f, height // 4 : height // 2, left : left + width // 4] = (1.0, 1.0, 0.9)
    return clip


def decode_mp4(data: bytes) -> tuple[list[np.ndarray], dict]:
    """The frames, and what the stream says (read while the container is open: PyAV 18.1.1 refuses after)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        codec = stream.codec_context
        return frames, {"codec": codec.name, "pix_fmt": codec.pix_fmt, "rate": stream.average_rate}


def test_mp4_decodes_to_the_frames_at_their_rate():
    clip = moving_clip(9, 32, 48)
    encoded = encode_video(clip, 16)
    assert (encoded.format, encoded.fallback, encoded.media_type) == ("mp4", None, "video/mp4")
    assert (encoded.width, encoded.height, encoded.num_frames, encoded.fps) == (48, 32, 9, 16)
    frames, stream = decode_mp4(encoded.data)
    assert (stream["codec"], stream["pix_fmt"], stream["rate"]) == ("h264", "yuv420p", 16)
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3)
    source = (clip * 255).round()
    for i, frame in enumerate(frames):
        errors = [np.abs(frame.astype(float) - s).mean() for s in source]
        # Close to its own frame, in order (each differs from the others by a moved square).
        assert errors[i] < 3.0 and int(np.argmin(errors)) == i, (i, errors)


def test_mp4_index_comes_first_so_it_plays_while_downloading():
    data = encode_video(moving_clip(5, 16, 16), 8).data
    assert data[4:8] == b"ftyp"
    assert 0 < data.find(b"moov") < data.find(b"mdat")


def test_odd_sides_are_padded_to_even():
    clip = moving_clip(5, 31, 47)
    encoded = encode_video(clip, 24)
    assert (encoded.width, encoded.height) == (48, 32)
    frames, stream = decode_mp4(encoded.data)
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3) and stream["rate"] == 24
    # The clip is there, top left (closer to its own frame than to the next one), and the extra row and column
    # repeat its edge.
    errors = [np.abs(frames[2][:31, :47].astype(float) - (clip[i] * 255).round()).mean() for i in (2, 3)]
    assert errors[0] < 5.0 and errors[0] < errors[1], errors
    assert np.abs(frames[2][31].astype(float) - frames[2][30]).mean() < 6.0


def test_webp_is_lossless():
    clip = moving_clip(6, 16, 24)
    encoded = encode_video(clip, 10, "webp")
    assert (encoded.format, encoded.fallback, encoded.media_type) == ("webp", None, "image/webp")
    with Image.open(io.BytesIO(encoded.data)) as image:
        assert image.format == "WEBP" and image.n_frames == 6
        for i in range(6):
            image.seek(i)
            rgb = np.asarray(image.convert("RGB"))
            assert image.info["duration"] == 100
            np.testing.assert_array_equal(rgb, (clip[i] * 255).round().astype(np.uint8))


def test_without_h264_it_falls_back_to_webp_and_says_why(monkeypatch):
    monkeypatch.setattr(video, "h264_unavailable", lambda: "no libx264 here")
    encoded = encode_video(moving_clip(3, 16, 16), 8, "mp4")
    assert (encoded.format, encoded.fallback) == ("webp", "no libx264 here")
    assert encoded.data[:4] == b"RIFF" and encoded.data[8:12] == b"WEBP"


def test_h264_detection():
    assert h264_unavailable() is None  # the test extra installs PyAV, whose wheels ship libx264


def test_h264_detection_without_pyav(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    reason = h264_unavailable.__wrapped__()
    assert reason is not None and "PyAV" in reason
    assert "animated WebP" in caplog.text


def test_refuses_what_is_not_a_clip():
    with pytest.raises(ValueError, match="frames, height, width, 3"):
        encode_video(np.zeros((16, 16, 3), np.float32), 8)
    with pytest.raises(ValueError, match="video format"):
        encode_video(np.zeros((1, 16, 16, 3), np.float32), 8, "gif")
