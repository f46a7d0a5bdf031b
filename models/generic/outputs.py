"""What a generic call returns, per request: its row of the call's output (an image, a clip's frames, a waveform),
as the engine's outputs take them, and the sample rate of the sound a pipeline makes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def output_row(output: Any, names: tuple[str, ...], row: int, modality: str) -> np.ndarray:
    """A request's row of the call's output, as float32 in [0, 1] ([H, W, C] image, [F, H, W, 3] frames) or a
    waveform [channels, samples] in [-1, 1]."""
    for name in names:
        # A dict, a Modular pipeline's PipelineState (`get`), or a pipeline's output dataclass.
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is None:
            continue
        item = to_numpy(value[row])
        if modality == "audio":
            item = np.asarray(item, dtype=np.float32)
            return item[None] if item.ndim == 1 else item
        return np.asarray(item, dtype=np.float32)
    raise RuntimeError(f"the call returned none of {', '.join(names)}")


def to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().numpy()
    if isinstance(value, list):  # frames as images
        return np.stack(
            [np.asarray(v, dtype=np.float32) / (255.0 if np.asarray(v).dtype == np.uint8 else 1.0) for v in value]
        )
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return np.asarray(value, dtype=np.float32) / 255.0
    return value


def sample_rate(pipe: Any) -> int | None:
    """The sample rate of the sound the pipeline makes, where a component says it."""
    for component, names in (
        ("vocoder", ("output_sampling_rate", "sampling_rate", "sample_rate")),
        ("vae", ("sampling_rate",)),
        ("audio_vae", ("sample_rate", "sampling_rate")),
    ):
        config = getattr(getattr(pipe, component, None), "config", None)
        for name in names:
            value = getattr(config, name, None) if config is not None else None
            if isinstance(value, int | float) and value > 0:
                return int(value)
    return None
