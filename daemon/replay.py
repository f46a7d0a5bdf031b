"""Streams a client can come back to (issue 53, item 7): the native stream's events are kept, numbered, for
`--reconnect-window` seconds after its client goes away and after the stream ends.

The engine's events of a native request (`POST /v1/generations`) are read by a task of its own (daemon/native_api.py
`_pump`, `Replay.task`), which renders each into an SSE event and keeps it here, numbered (`Replay.add`: the SSE `id:`
field, 1, 2, ...); every client of the stream follows the kept events (`Replay.follow`): the one that made it, and
any that come back through `GET /v1/generations/{id}/events` (or by sending the POST again with its
`Idempotency-Key`) with `Last-Event-ID: N`, which get every event after N once, then the live ones. Previews, latents
and progress a returning client missed are coalesced to the latest of each (never those a client still connected
has yet to read). A stream left without a client for the window is cancelled at its next step boundary, as a hang-up
was before (a window of 0: at once); a finished stream's events are dropped the window after its terminal event.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.streaming import KEEPALIVE, ClientGone, send, send_event

log = logging.getLogger(__name__)

# What a returning client may miss and get only the latest of.
COALESCED = frozenset({"progress", "preview", "latent"})
TERMINAL = frozenset({"completed", "cancelled", "failed"})
# Sent first on every stream: a browser's EventSource comes back after this many milliseconds, not its default 3 s.
RETRY_MS = 1000


@dataclass
class Frame:
    seq: int
    name: str
    data: dict
    blob: bytes | None = None


@dataclass
class Cursor:
    """Where one client of the stream is: the last event it was sent."""

    seq: int


@dataclass
class Replay:
    request_id: str
    owner: str
    window: float
    frames: list[Frame] = field(default_factory=list)
    ended: bool = False
    cursors: list[Cursor] = field(default_factory=list)
    task: asyncio.Task | None = None
    _changed: asyncio.Future | None = None
    _timer: asyncio.TimerHandle | None = None
    _forget: Callable[[], None] | None = None

    def add(self, name: str, data: dict, blob: bytes | None = None) -> Frame:
        """A new event; older ones of a coalesced kind that every connected client has read are dropped."""
        seq = self.frames[-1].seq + 1 if self.frames else 1
        if name in COALESCED:
            read = min((c.seq for c in self.cursors), default=seq)
            self.frames = [f for f in self.frames if f.name != name or f.seq > read]
        frame = Frame(seq, name, data, blob)
        self.frames.append(frame)
        self.ended = self.ended or name in TERMINAL
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None
        if self.ended:
            self._arm(self._drop)
        return frame

    def after(self, seq: int) -> Frame | None:
        i = bisect.bisect_right(self.frames, seq, key=lambda f: f.seq)
        return self.frames[i] if i < len(self.frames) else None

    async def follow(
        self,
        response: web.StreamResponse,
        after: int,
        keepalive: float,
        on_retry: Callable[[Frame], Awaitable[bool]] | None = None,
        cut: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Writes to `response` every event after `after`, then each new one, up to the terminal event (True), or
        until `on_retry` takes a failed event that may be retried elsewhere (False: the stream was handed over).
        ClientGone when the client goes away; the stream then waits the window for another, unless `cut()` says
        the server cut the connection for reading nothing (daemon/connections.py): a client that reads nothing is
        not waited for, and its request is cancelled at once, as with a window of 0."""
        rids = [self.request_id]
        cursor = Cursor(after)
        self.cursors.append(cursor)
        if not self.ended:  # (a finished stream's timer drops its events)
            self._disarm()
        try:
            await send(response, f"retry: {RETRY_MS}\n\n".encode(), rids)
            while True:
                frame = self.after(cursor.seq)
                if frame is None:
                    if self.ended:
                        return True
                    if self._changed is None:
                        self._changed = asyncio.get_running_loop().create_future()
                    done, _ = await asyncio.wait({self._changed}, timeout=keepalive)
                    if not done:
                        await send(response, KEEPALIVE, rids)
                    continue
                if on_retry is not None and frame.data.get("retry") and await on_retry(frame):
                    return False
                await send_event(response, frame.name, frame.data, rids, frame.blob, event_id=frame.seq)
                cursor.seq = frame.seq
        except ClientGone:
            if not self.ended and not cut():
                message = "request %s: the client went away after event %d; kept %gs for it to come back"
                log.info(message, self.request_id, cursor.seq, self.window)
            raise
        finally:
            self.cursors.remove(cursor)
            if not self.cursors and not self.ended:
                if cut():  # (its handler may also have been cancelled, not told ClientGone)
                    self.window = 0.0  # nobody comes back: its events are not kept after its end either
                    self._disarm()
                    self._abandon()
                else:
                    self._arm(self._abandon)

    def _arm(self, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(self.window, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _abandon(self) -> None:
        """The window passed without a client: the request is cancelled (its pump's `track` cancels it)."""
        self._timer = None
        if not self.cursors and not self.ended and self.task is not None:
            self.task.cancel()

    def _drop(self) -> None:
        self._timer = None
        if self._forget is not None:
            self._forget()

    def close(self) -> None:
        self._disarm()
        if self.task is not None:
            self.task.cancel()


class Replays:
    """The kept streams by request id."""

    def __init__(self) -> None:
        self.streams: dict[str, Replay] = {}

    def start(self, replay: Replay, pump: Awaitable[None]) -> Replay:
        self.streams[replay.request_id] = replay
        replay._forget = lambda: self.streams.pop(replay.request_id, None)
        replay.task = asyncio.ensure_future(pump)
        return replay

    def get(self, request_id: str, owner: str) -> Replay | None:
        replay = self.streams.get(request_id)
        return replay if replay is not None and replay.owner == owner else None

    async def close(self) -> None:
        replays = list(self.streams.values())
        for replay in replays:
            replay.close()
        await asyncio.gather(*(r.task for r in replays if r.task is not None), return_exceptions=True)
        self.streams.clear()


def last_event_id(request: web.Request) -> int:
    """The `Last-Event-ID` a returning client sends (0 without one: from the first event)."""
    value = request.headers.get("Last-Event-ID", "").strip()
    if not value:
        return 0
    if not value.isdigit() or len(value) > 12:
        raise ApiError(400, f"Last-Event-ID must be an event's number (the id: field); got {value[:40]!r}",
                       param="Last-Event-ID")  # fmt: skip
    return int(value)


REPLAYS = web.AppKey("replays", Replays)


async def replays_ctx(app: web.Application) -> AsyncIterator[None]:
    app[REPLAYS] = Replays()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            await app[REPLAYS].close()
