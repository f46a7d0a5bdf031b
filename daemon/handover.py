"""Requests carried over a heal: what a failing group had not started is served by the next rank 0, not refused.

When a group fails, rank 0 ends each request that had not run a step with `Failed(retry)`. Under the launcher
(daemon/listener.py) such a request is not answered 503: rank 0 hands its client's connection (the descriptor) and
the request (rebuilt as HTTP from what rank 0 read of it) to the launcher, which gives both to the next rank 0 with
the listening socket. That one reads the request as if it had just arrived, so its client sees one answer, later.
A stream whose head (and `queued` event) its client already has goes on: the next rank 0 keeps its request ids and
writes no second status line, so the client reads `queued` again, then the rest of the stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import uuid
from collections.abc import Sequence

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from diffusiond.daemon.api import ApiError, NotStarted
from diffusiond.daemon.connections import CONNECTIONS
from diffusiond.daemon.edge import SENT, SentBody
from diffusiond.daemon.listener import LISTENER_ENV, Carried, hand

log = logging.getLogger(__name__)

# Headers that describe this hop's framing, rebuilt for the body as carried.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"expect"})
_FORM_NAME = re.compile(r"[A-Za-z0-9_.\[\]-]{1,64}")


# Connections carried over a heal whose streams had started, to the request ids their clients were told.
CARRIED = web.AppKey("carried", dict)


def carried_ids(request: web.Request, count: int) -> list[str] | None:
    """The ids to give this request's `count` requests: those its client was told before the heal, or None."""
    ids = request.app[CARRIED].pop(request.protocol, None)
    return ids if ids is not None and len(ids) == count else None


@web.middleware
async def carry_over(request: web.Request, handler) -> web.StreamResponse:
    """A request that ends NotStarted before its answer began: its connection goes to the next rank 0."""
    try:
        return await handler(request)
    except NotStarted as exc:
        if await hand_over(request, _http(exc, request)):
            return web.Response(status=204)  # never written: the connection is the next rank 0's
        raise


async def hand_over(
    request: web.Request, fallback: bytes, request_ids: Sequence[str] = (), response: web.StreamResponse | None = None
) -> bool:
    """Gives the request and its connection to the launcher for the next rank 0 (True), or returns False (no
    launcher, a body that cannot be sent again, a connection gone). `fallback`: what the client gets if no rank 0
    serves it, the SSE event it would have got when its stream (`response`) had started (`request_ids` its ids)."""
    path = os.environ.get(LISTENER_ENV)
    transport = request.transport
    sent = request.get(SENT)
    if not path or transport is None or transport.is_closing():
        return False
    body = _encoded(sent) if sent is not None else (b"", None) if not request.body_exists else None
    sock = transport.get_extra_info("socket")
    if body is None or sock is None:
        return False
    if response is not None and response.chunked:
        fallback = f"{len(fallback):x}\r\n".encode() + fallback + b"\r\n0\r\n\r\n"
    carried = Carried(_raw(request, *body), fallback, list(request_ids) if response is not None else [])
    try:
        taken = await asyncio.get_running_loop().run_in_executor(None, hand, path, sock.fileno(), carried)
    except (OSError, EOFError) as exc:
        log.warning("could not hand %s %s to the launcher: %s", request.method, request.path, exc)
        return False
    if taken:
        log.info("%s %s not started: handed to the launcher for the next rank 0", request.method, request.path)
        transport.abort()  # closes this process's copy only: the launcher's keeps the connection open
    return taken


async def adopt(app: web.Application, carried: list[tuple[socket.socket, Carried]]) -> int:
    """The next rank 0: serves each carried request on its connection as if it had just arrived."""
    loop = asyncio.get_running_loop()
    for sock, item in carried:
        sock.setblocking(False)
        transport, protocol = await loop.connect_accepted_socket(app[CONNECTIONS], sock)
        if isinstance(protocol, RequestHandler):
            if item.request_ids:
                protocol.transport = _HeadSent(transport, item.fallback)
                app[CARRIED][protocol] = item.request_ids
            if item.raw:  # what was read of the request; nothing when the launcher only looked at its head
                protocol.data_received(item.raw)
    return len(carried)


class _HeadSent:
    """The transport of a stream that had started: the new status line and headers are dropped (the client has
    them). Should the new answer not be the stream (the model did not come back), the client gets the event it
    would have got from the failing rank 0 instead."""

    def __init__(self, transport: asyncio.Transport, fallback: bytes) -> None:
        self._transport = transport
        self._fallback = fallback
        self._head: bytearray | None = bytearray()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def write(self, data) -> None:
        if self._head is not None:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data, self._head = bytes(self._head[:end]), bytes(self._head[end + 4 :]), None
            if not head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")):
                self._transport.write(self._fallback)
                self._transport.close()
                return
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))


def _encoded(sent: SentBody) -> tuple[bytes, bytes | None] | None:
    """The body to send again and, for a form, its new Content-Type; None when it cannot be sent again as read."""
    if sent.data is not None:
        return sent.data, None
    assert sent.fields is not None and sent.files is not None
    parts = [(n, v.encode()) for n, v in sent.fields.items()] + [(n, d) for n, ds in sent.files.items() for d in ds]
    if not all(_FORM_NAME.fullmatch(name) for name, _ in parts):
        return None
    boundary = uuid.uuid4().hex.encode()
    body = bytearray()
    for name, value in parts:
        body += b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + name.encode() + b'"\r\n\r\n'
        body += value + b"\r\n"
    body += b"--" + boundary + b"--\r\n"
    return bytes(body), b"multipart/form-data; boundary=" + boundary


def _raw(request: web.Request, body: bytes, content_type: bytes | None) -> bytes:
    version = request.version
    lines = [f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}".encode()]
    for name, value in request.raw_headers:
        low = name.lower()
        if low in _FRAMING or (content_type is not None and low == b"content-type"):
            continue
        lines.append(name + b": " + value)
    if content_type is not None:
        lines.append(b"Content-Type: " + content_type)
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _http(error: ApiError, request: web.Request) -> bytes:
    """The error as a whole HTTP answer, for the launcher to send if no rank 0 comes."""
    response = error.response()
    body = response.body
    assert isinstance(body, bytes)
    head = [f"HTTP/{request.version.major}.{request.version.minor} {response.status} {response.reason}"]
    head += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in ("content-length", "connection")]
    head += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
