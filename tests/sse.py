"""Server-Sent Events in tests: (event name, data) pairs from a live text/event-stream response.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from sse import sse_events`.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp


async def sse_events(resp: aiohttp.ClientResponse):
    """Yields (event name, data dict) from a text/event-stream response."""
    name, data = None, []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:") :].strip())
    assert not data, "stream ended inside an event"


async def staggered_streams(session: aiohttp.ClientSession, url: str, bodies: list[dict]) -> list[list[tuple]]:
    """Native generation streams of `bodies`, each started once the one before has made progress (so later ones
    join a running batch); each stream's (event name, data) pairs."""
    started = [asyncio.Event() for _ in bodies]

    async def one(i: int) -> list[tuple]:
        if i:
            await started[i - 1].wait()
        async with session.post(url, json=bodies[i]) as resp:
            assert resp.status == 200, await resp.text()
            events = []
            async for name, data in sse_events(resp):
                events.append((name, data))
                if name == "progress":
                    started[i].set()
            return events

    return list(await asyncio.gather(*(one(i) for i in range(len(bodies)))))
