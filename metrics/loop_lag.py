"""Event-loop lag: how late the loop wakes from a timed sleep. A loop that runs torch (or any blocking call)
shows up here as lag of a whole step."""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram


async def watch_loop_lag(histogram: Histogram, interval: float = 0.1) -> None:
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval)
        histogram.observe(max(0.0, loop.time() - start - interval))
