"""Where images are encoded: a latent-resolution preview of at most INLINE_PIXELS in place on the event loop (a hop to
the encoder pool costs more than the work), anything larger in the pool. Both give the same bytes, both are timed."""

from __future__ import annotations

import concurrent.futures
import io

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from diffusiond.daemon.image_encoding import INLINE_PIXELS, encode_image
from diffusiond.daemon.state import ENCODERS, METRICS
from diffusiond.daemon.streaming import encode_small
from diffusiond.metrics.registry import Metrics


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


class FakeRequest:
    def __init__(self, app: web.Application) -> None:
        self.app = app


def _encoded(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("diffusiond_stage_seconds_count", {"stage": "encode_response"}) or 0.0


@pytest.mark.asyncio
async def test_small_previews_are_encoded_in_place_and_large_ones_in_the_pool():
    app = web.Application()
    app[ENCODERS] = pool = CountingPool()
    app[METRICS] = metrics = Metrics()
    request = FakeRequest(app)
    rng = np.random.default_rng(0)
    side = int(INLINE_PIXELS**0.5)
    try:
        for shape, jobs in (((side, side), 0), ((8, 8), 0), ((side, side + 1), 1), ((4 * side, 4 * side), 2)):
            image = rng.random((*shape, 3), dtype=np.float32)
            data = await encode_small(request, image, "png")
            assert pool.jobs == jobs, shape
            assert data == encode_image(image, "png")
            with Image.open(io.BytesIO(data)) as decoded:
                assert decoded.size == (shape[1], shape[0])
        assert _encoded(metrics) == 4  # in place or not, each is in the encode_response stage
    finally:
        pool.shutdown()
