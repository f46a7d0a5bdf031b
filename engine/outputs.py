"""What a request's client sees: the events of its mailbox. Rank-local (never sent between ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Queued:
    request_id: str
    # Requests waiting ahead of this one when it was queued.
    position: int


@dataclass(frozen=True, slots=True)
class Progress:
    request_id: str
    step: int
    total: int


@dataclass(frozen=True, slots=True)
class Paused:
    """Paused after `step` steps for requests of a higher class (engine/scheduler.py); its state is kept."""

    request_id: str
    step: int
    total: int


@dataclass(frozen=True, slots=True)
class Resumed:
    """Admitted again: it goes on from step `step`, where it was paused."""

    request_id: str
    step: int
    total: int


@dataclass(frozen=True, slots=True)
class Preview:
    request_id: str
    step: int
    total: int
    # uint8 [h, w, 3] at latent resolution: the predicted clean image after `step` steps (a video: its frames side
    # by side, a strip).
    image: np.ndarray


@dataclass(frozen=True, slots=True)
class Latent:
    request_id: str
    step: int
    total: int
    # The sampler's current model-space latent after `step` steps, float32, as the transformer sees it.
    latent: np.ndarray


@dataclass(frozen=True, slots=True)
class Sound:
    # float32 [channels, samples] in [-1, 1]: the waveform its pipeline returns.
    samples: np.ndarray
    sample_rate: int


@dataclass(frozen=True, slots=True)
class Completed:
    request_id: str
    seed: int
    # float32 [H, W, 3] in [0, 1], exactly what diffusers' `output_type="np"` gives; a video family's clip:
    # float32 [F, H, W, 3] (its pipeline's `output_type="np"` frames of one video).
    image: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    # A clip's sound track (families with `audio_sample_rate`); None: silent.
    audio: Sound | None = None
    # Answered from the result cache (engine/result_cache.py), without a step.
    cached: bool = False


@dataclass(frozen=True, slots=True)
class Cancelled:
    request_id: str
    reason: str = "cancelled"


@dataclass(frozen=True, slots=True)
class Failed:
    request_id: str
    error: str
    # The engine (or its group) stopped before the request ran a step: sending it again is safe, and a restarted
    # group serves it (HTTP: 503 with Retry-After rather than 500).
    retry: bool = False


Event = Queued | Progress | Paused | Resumed | Preview | Latent | Completed | Cancelled | Failed
TERMINAL = (Completed, Cancelled, Failed)
# A slow reader may miss intermediate progress and previews (only the newest is kept), never a terminal event.
COALESCIBLE = (Progress, Preview, Latent)
