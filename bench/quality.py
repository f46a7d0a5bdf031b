"""Agreement of two images (float RGB in [0, 1]): PSNR and SSIM, as the benchmarks and tools report them."""

from __future__ import annotations

import numpy as np


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(a: np.ndarray, b: np.ndarray, window: int = 7) -> float:
    """Mean SSIM of two float images in [0, 1] ([H, W, C]), uniform 7x7 windows, channels averaged; clips
    ([F, H, W, C]): the mean over their frames."""
    if a.ndim == 4:
        return float(np.mean([ssim(fa, fb, window) for fa, fb in zip(a, b, strict=True)]))
    c1, c2 = 0.01**2, 0.03**2

    def local_mean(x: np.ndarray) -> np.ndarray:
        windows = np.lib.stride_tricks.sliding_window_view(x, (window, window), axis=(0, 1))
        return windows.mean(axis=(-2, -1))

    a, b = a.astype(np.float64), b.astype(np.float64)
    mu_a, mu_b = local_mean(a), local_mean(b)
    var_a = local_mean(a * a) - mu_a**2
    var_b = local_mean(b * b) - mu_b**2
    cov = local_mean(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(s.mean())
