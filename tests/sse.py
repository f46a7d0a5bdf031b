"""Server-Sent Events in tests: (event name, data) pairs from a live text/event-stream response.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from sse import sse_events`.
"""

from __future__ import annotations

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
