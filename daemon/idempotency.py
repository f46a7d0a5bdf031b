"""`Idempotency-Key` on the POSTs that start work (issue 33): a client that retries after a timeout gets the answer
of its first try, and the work runs once.

The key is the tenant's own (two tenants may use the same string) and names one route. The first request with a
key runs; the same key with the same body, sent again (or at the same time) within WINDOW_S, gets the first one's
answer: the same images, the same video job, byte for byte (`Idempotent-Replayed: true` says it is a copy). The
same key with another body is 422. An answer that is an error (a full queue, a bad field) is not kept: the next
try runs again. A streamed answer (SSE) cannot be sent twice: a repeat gets 409 naming the first's request ids
(its status: `GET /v1/generations/{id}`).

Answers are kept in memory, at most MAX_BYTES of them and MAX_ENTRIES keys (past either, the tenant that holds the
most forgets its oldest first, after which a repeat of it runs again: one tenant's traffic never pushes out another's
keys while it holds more than that one); a restart forgets them, except the keys of `POST /v1/videos` under a job
database, which daemon/job_db.py keeps with the jobs (`remember_key`: a retry after a restart, or through another
replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from diffusiond.daemon.api import ApiError

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
WINDOW_S = 24 * 3600.0
MAX_ENTRIES = 10_000
MAX_BYTES = 256 << 20
KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


@dataclass
class Stored:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str]


@dataclass
class Entry:
    fingerprint: str
    created: float
    done: asyncio.Future[Stored] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # A streamed answer's request ids, once queued (`started`).
    request_ids: list[str] = field(default_factory=list)
    size: int = 0


def fingerprint(*parts: bytes | str) -> str:
    """What makes two requests the same request: their bodies (for a form, its fields and files)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class IdempotencyKeys:
    def __init__(self, window: float = WINDOW_S, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.window, self.max_entries, self.max_bytes = window, max_entries, max_bytes
        self.entries: OrderedDict[tuple[str, ...], Entry] = OrderedDict()
        self.bytes = 0
        # What each tenant holds: its keys and their answers' bytes (`_bound` takes from the largest first).
        self.held: dict[str, list[int]] = {}
        self.clock = time.monotonic

    async def once(
        self, request: web.Request, tenant: str, digest: str, make: Callable[[], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """`make()`'s answer, or the answer the first request with this Idempotency-Key got."""
        key = request.headers.get(HEADER)
        if key is None:
            return await make()
        if not KEY.match(key):
            raise ApiError(400, f"{HEADER}: 1 to 255 printable ASCII characters, no spaces", param=HEADER)
        self._sweep()
        ident = (tenant, request.method, request.path, key)
        entry = self.entries.get(ident)
        if entry is not None:
            if entry.fingerprint != digest:
                raise ApiError(
                    422,
                    f"{HEADER} {key!r} was used with another body; use a new key for a new request",
                    param=HEADER,
                    code="idempotency_key_reused",
                )
            if entry.request_ids and not entry.done.done():  # a stream that is running
                raise self._streamed(key, entry)
            stored = await asyncio.shield(entry.done)
            return web.Response(
                status=stored.status,
                body=stored.body,
                content_type=stored.content_type,
                headers={**stored.headers, REPLAYED: "true"},
            )
        entry = Entry(digest, self.clock())
        entry.done.add_done_callback(_retrieved)
        self.entries[ident] = entry
        self.held.setdefault(tenant, [0, 0])[0] += 1
        request[ENTRY] = entry
        try:
            response = await make()
        except BaseException as exc:
            if entry.request_ids:  # a stream that started (its client went away): it runs; a repeat goes on with it
                if not entry.done.done():
                    entry.done.set_exception(self._streamed(key, entry))
                raise
            if self.entries.get(ident) is entry:
                self._forget(ident)  # an error is not an answer to keep: the next try runs
            if not entry.done.done():
                error = exc if isinstance(exc, ApiError) else _gone(key)
                entry.done.set_exception(error)
            raise
        if isinstance(response, web.Response) and isinstance(response.body, bytes) and response.status < 400:
            kept = {k: v for k, v in response.headers.items() if k.lower().startswith("x-")}
            entry.size = len(response.body)
            entry.done.set_result(Stored(response.status, response.body, response.content_type, kept))
            self.bytes += entry.size
            self.held[tenant][1] += entry.size
            self._bound()
        else:  # streamed (or an error answered as a response): not kept
            entry.done.set_exception(self._streamed(key, entry))
            if response.status >= 400 and self.entries.get(ident) is entry:
                self._forget(ident)
        return response

    def stream_of(self, request: web.Request, tenant: str, digest: str) -> list[str]:
        """The request ids of the stream the first request with this Idempotency-Key and body started (none: not
        a repeat of a stream); a repeat may go on with it while its events are kept (daemon/replay.py)."""
        key = request.headers.get(HEADER)
        entry = self.entries.get((tenant, request.method, request.path, key)) if key is not None else None
        return list(entry.request_ids) if entry is not None and entry.fingerprint == digest else []

    def _streamed(self, key: str, entry: Entry) -> ApiError:
        ids = ", ".join(entry.request_ids) or "unknown"
        return ApiError(
            409,
            f"a streamed request with {HEADER} {key!r} ran already (request {ids}); its events went to its own "
            f"client: GET /v1/generations/ID for its status",
            param=HEADER,
            code="idempotency_key_streamed",
        )

    def _sweep(self) -> None:
        cutoff = self.clock() - self.window
        while self.entries:
            ident, entry = next(iter(self.entries.items()))
            if entry.created > cutoff:
                break
            self._forget(ident)

    def _bound(self) -> None:
        while (over_entries := len(self.entries) > self.max_entries) or self.bytes > self.max_bytes:
            measure = 0 if over_entries else 1
            for tenant in sorted(self.held, key=lambda t: -self.held[t][measure]):  # the largest holder first
                ident = next((i for i, e in self.entries.items() if i[0] == tenant and e.done.done()), None)
                if ident is not None:
                    self._forget(ident)
                    break
            else:
                return  # nothing finished to forget

    def _forget(self, ident: tuple[str, ...]) -> None:
        entry = self.entries.pop(ident)
        self.bytes -= entry.size
        held = self.held[ident[0]]
        held[0] -= 1
        held[1] -= entry.size
        if held[0] == 0:
            del self.held[ident[0]]


def started(request: web.Request, request_ids: list[str]) -> None:
    """A streamed answer's request ids, for a repeat's 409 (no-op without an Idempotency-Key)."""
    entry = request.get(ENTRY)
    if entry is not None:
        entry.request_ids = list(request_ids)


def _gone(key: str) -> ApiError:
    return ApiError(
        409,
        f"the first request with {HEADER} {key!r} ended without an answer (its client went away); send it again",
        param=HEADER,
        code="idempotency_key_retry",
    )


def _retrieved(future: asyncio.Future) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        future.exception()  # an answer nobody waited for is not an error to report


ENTRY = web.RequestKey("idempotency_entry", Entry)
KEYS = web.AppKey("idempotency_keys", IdempotencyKeys)
