"""One mailbox per request: the engine puts without blocking, the client awaits; progress coalesces for slow
readers, terminal events never do (vLLM's `RequestOutputCollector`)."""

from __future__ import annotations

import asyncio
from collections import deque

from diffusiond.engine.outputs import COALESCIBLE, TERMINAL, Event, Latent, Preview, Progress

# How many unread events of a kind a slow reader may have before the oldest goes. Only the newest progress matters;
# previews are few (every K steps) and each is wanted, so a handful is kept.
UNREAD_LIMIT = {Progress: 1, Preview: 4, Latent: 4}


class Mailbox:
    __slots__ = ("_items", "_ready", "closed")

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._ready = asyncio.Event()
        self.closed = False

    def put(self, event: Event) -> None:
        """Event-loop thread only. Never blocks."""
        if self.closed:
            return
        if isinstance(event, COALESCIBLE):
            same = [i for i, old in enumerate(self._items) if type(old) is type(event)]
            if len(same) >= UNREAD_LIMIT[type(event)]:
                del self._items[same[0]]
        self._items.append(event)
        if isinstance(event, TERMINAL):
            self.closed = True
        self._ready.set()

    async def get(self) -> Event:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()
