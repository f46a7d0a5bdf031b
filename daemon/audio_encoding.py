"""Sound as files: a waveform (float32 [channels, samples] in [-1, 1], as a pipeline returns it) as WAV (16-bit PCM,
the standard library's `wave`) or FLAC (lossless, through PyAV where it is installed: the video extra). Run in the
encoder pool, never on the event loop."""

from __future__ import annotations

import fractions
import io
import wave
from dataclasses import dataclass

import numpy as np

from diffusiond.engine.outputs import Completed, Sound

FORMATS = ("wav", "flac")
# The rate of a waveform whose pipeline does not say its own (none known to do so): CD's.
DEFAULT_RATE = 44100


@dataclass(frozen=True)
class EncodedSound:
    data: bytes
    format: str
    sample_rate: int
    channels: int
    samples: int


def completed_sound(event: Completed) -> Sound:
    """A sound model's result: the track the executor attached where the model says its sample rate, else the
    waveform as its call returned it, at DEFAULT_RATE."""
    return event.audio or Sound(event.image, DEFAULT_RATE)


def encode_sound(sound: Sound, fmt: str = "wav") -> EncodedSound:
    """`sound` as a `fmt` file ("wav" or "flac"); ValueError for another format, or FLAC without PyAV."""
    samples = np.asarray(sound.samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[None]
    if samples.ndim != 2:
        raise ValueError(f"a waveform is [channels, samples]; got shape {samples.shape}")
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")  # [channels, n]
    channels, count = pcm.shape
    if fmt == "wav":
        out = io.BytesIO()
        with wave.open(out, "wb") as file:
            file.setnchannels(channels)
            file.setsampwidth(2)
            file.setframerate(sound.sample_rate)
            file.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # interleaved
        data = out.getvalue()
    elif fmt == "flac":
        data = _flac(pcm, sound.sample_rate)
    else:
        raise ValueError(f"audio_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return EncodedSound(data, fmt, sound.sample_rate, channels, count)


def _flac(pcm: np.ndarray, rate: int) -> bytes:
    try:
        import av
    except ImportError:  # pragma: no cover - the video extra brings it
        raise ValueError("audio_format flac needs PyAV (pip install 'diffusiond[video]'); wav needs nothing") from None
    out = io.BytesIO()
    layout = "mono" if pcm.shape[0] == 1 else "stereo"
    with av.open(out, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.T.reshape(1, -1)), format="s16", layout=layout)
        frame.sample_rate = rate
        frame.pts, frame.time_base = 0, fractions.Fraction(1, rate)
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def decode_wav(data: bytes) -> Sound:
    """A WAV file's waveform (16-bit PCM): what a client of the native API reads back."""
    with wave.open(io.BytesIO(data), "rb") as file:
        channels, rate = file.getnchannels(), file.getframerate()
        pcm = np.frombuffer(file.readframes(file.getnframes()), dtype="<i2").reshape(-1, channels).T
    return Sound(pcm.astype(np.float32) / 32767.0, rate)
