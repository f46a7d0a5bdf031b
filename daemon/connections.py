"""Connections: the listening socket, how many may be open, how long one may idle, and the open-file limit.

A client that opens connections and sends nothing must not take the file descriptors that `/health`, a
generation or a LoRA file need. So an idle connection (between requests, or before its request head is whole) is
closed after `keepalive_timeout`; past `max_connections` the longest idle are closed as new ones arrive; and when
none is idle, a few more are let in for the probes alone (`/health`, `/ready`, `/metrics`), while anything else on
them is answered 503. The soft open-file limit is raised to the hard one at start, and the cap kept below it.

A client that stops reading parks its handler with the payload the engine already let go: a connection whose writes
have waited on the client (aiohttp paused writing: its buffer is past the high-water mark) for `write_timeout`
seconds without a break is aborted, which ends its handler (a stream's request is cancelled) and frees its buffers.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_log import AccessLogger
from aiohttp.web_protocol import RequestHandler

from diffusiond.daemon.api import ApiError, retry_later
from diffusiond.daemon.config import ServeConfig

log = logging.getLogger(__name__)

PROBES = frozenset({"/health", "/ready", "/metrics"})
# Connections past the cap, when none is idle, for the probes.
PROBE_SLOTS = 32
# File descriptors kept for everything but client connections: model and LoRA files, temp files, pipes, threads.
FD_RESERVE = 256
# Idle connections closed at once when the cap is reached, so that a flood is not handled one accept at a time.
EVICT_BATCH = 16
BACKLOG = 1024
# A body left unread after its answer (a 413) is drained for at most this long, so that the client reads the answer
# rather than a reset; then the connection is closed.
LINGER_S = 2.0
_REFUSAL_BODY = (
    b'{"error":{"message":"too many open connections; try again","type":"server_error","param":null,'
    b'"code":"server_busy"}}'
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


def open_files_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else (hard if hard != resource.RLIM_INFINITY else 1 << 20)


def raise_open_files_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard limit (a unit's LimitNOFILE, a container's ulimit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else hard


def connection_limit(config: ServeConfig, open_files: int) -> int:
    """`max_connections`, kept below the open-file limit (less what the process needs besides)."""
    limit = min(config.max_connections, max(16, open_files - FD_RESERVE - PROBE_SLOTS))
    if limit < config.max_connections:
        log.warning(
            "serving at most %d connections, not --max-connections %d: the open-file limit is %d (raise LimitNOFILE)",
            limit,
            config.max_connections,
            open_files,
        )
    return limit


def runner_options(config: ServeConfig) -> dict:
    """aiohttp's per-connection settings: the idle timeout (from accept, so it covers a slow request head too), and
    the access log without URL signatures."""
    return {
        "keepalive_timeout": config.keepalive_timeout,
        "lingering_time": LINGER_S,
        "access_log_class": RedactingAccessLogger,
    }


# A signed URL's signature (daemon/files.py): whoever reads the log could fetch the file with it until it expires.
_SIGNATURE = re.compile(r"(signature=)[^&\s\"]+", re.IGNORECASE)


class RedactingAccessLogger(AccessLogger):
    """aiohttp's access log line, with every `signature=` value (the request line's, a Referer's) written as
    `signature=REDACTED`."""

    def _format_line(self, request, response, time):  # type: ignore[override]
        return [
            (key, _SIGNATURE.sub(r"\1REDACTED", value) if isinstance(value, str) else value)
            for key, value in super()._format_line(request, response, time)
        ]


# How long a cut connection is remembered (`ConnectionGuard.was_cut`).
CUT_REMEMBERED_S = 30.0


class ConnectionGuard:
    """The protocol factory in front of aiohttp's: counts connections, closes the longest idle past the cap, refuses
    past cap + PROBE_SLOTS. A connection is busy while one of its requests is handled (`connection_middleware`)."""

    def __init__(self, limit: int, write_timeout: float) -> None:
        self.server: web.Server | None = None  # set by `listen`
        self.limit = limit
        self.write_timeout = write_timeout
        self.busy: dict[object, int] = {}
        # Since when each connection whose writes wait on its client has waited (loop time).
        self.stalled: dict[object, float] = {}
        self.refused = 0
        self.evicted = 0
        self.cut = 0
        # The connections cut lately, by id, and when (loop time): their streams are not kept for a return
        # (daemon/replay.py), since their clients read nothing. Ids, not the handlers: a cut handler is let go.
        self.cut_at: dict[int, float] = {}

    @property
    def open(self) -> int:
        return 0 if self.server is None else len(self.server.connections)

    def over_limit(self) -> bool:
        return self.open > self.limit

    def __call__(self) -> asyncio.BaseProtocol:
        assert self.server is not None
        if self.open >= self.limit:
            self._evict(self.open - self.limit + EVICT_BATCH)
            if self.open >= self.limit + PROBE_SLOTS:
                self.refused += 1
                return _Refusal()
        return _answer_malformed(self.server())

    def _evict(self, count: int) -> None:
        assert self.server is not None
        for handler in self.server.connections:  # oldest first
            if count <= 0:
                return
            if handler not in self.busy:
                handler.force_close()  # its task closes the transport; aiohttp forgets it on connection_lost
                self.evicted += 1
                count -= 1

    async def watch_writes(self) -> None:
        """Aborts connections whose writes have waited on their client for write_timeout (see the module doc)."""
        loop = asyncio.get_running_loop()
        every = min(1.0, self.write_timeout / 4)
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            stalled = {}
            # Kept long after the abort reaches its handler, however late a busy loop runs it.
            self.cut_at = {key: at for key, at in self.cut_at.items() if now - at < CUT_REMEMBERED_S}
            for handler in self.server.connections if self.server is not None else ():
                if not handler.writing_paused:
                    continue
                since = stalled[handler] = self.stalled.get(handler, now)
                if now - since >= self.write_timeout and handler.transport is not None:
                    log.info("cutting a client that read nothing for %gs (--write-timeout)", now - since)
                    self.cut_at[id(handler)] = now
                    handler.transport.abort()
                    self.cut += 1
            self.stalled = stalled

    def was_cut(self, request: web.BaseRequest) -> bool:
        """Whether `request`'s connection was cut for reading nothing (not a client that went away itself)."""
        return id(request.protocol) in self.cut_at

    def middleware(self):
        @web.middleware
        async def connection_middleware(request: web.Request, handler) -> web.StreamResponse:
            protocol = request.protocol
            if self.over_limit() and request.path not in PROBES:
                raise retry_later(
                    "too many open connections and none idle; try again (--max-connections)", "server_busy", close=True
                )
            self.busy[protocol] = self.busy.get(protocol, 0) + 1
            try:
                return await handler(request)
            finally:
                if (left := self.busy.pop(protocol) - 1) > 0:
                    self.busy[protocol] = left

        return connection_middleware


class _Refusal(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(REFUSAL)
        transport.close()


CONNECTIONS = web.AppKey("connections", ConnectionGuard)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (OSError when the address cannot be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Handler(RequestHandler):
    """aiohttp's handler, but a request its parser refuses (a NUL byte or a space in a header, a bad Content-Length,
    a request line past its limits) is answered in OpenAI's error shape, as any other 400 here, and logged as one
    INFO line: aiohttp answered it in plain text and logged its traceback at ERROR, so any client could fill the log
    with tracebacks. Other errors keep aiohttp's handling."""

    __slots__ = ()

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        lines = (exc.message or "").strip().splitlines()
        reason = (lines[0].rstrip(":. ") if lines else type(exc).__name__)[:120]  # not the client's bytes after it
        log.info("malformed request from %s refused (%d): %s", request.remote, exc.code, reason)
        error = ApiError(exc.code or 400, f"malformed request: {reason}", code="malformed_request", close=True)
        return error.response()


def _answer_malformed(handler: RequestHandler) -> RequestHandler:
    """`handler` (made by aiohttp's server, with its settings) as a `_Handler`."""
    handler.__class__ = _Handler
    return handler


class GuardedSite(web.BaseSite):
    """aiohttp's SockSite, with the ConnectionGuard as its protocol factory."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, guard: ConnectionGuard) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self._sock = sock
        self._guard = guard
        host, port = sock.getsockname()[:2]
        self._name = f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard, sock=self._sock, backlog=self._backlog)
        self._watch = asyncio.create_task(self._guard.watch_writes())

    async def stop(self) -> None:
        self._watch.cancel()
        await super().stop()


async def listen(runner: web.AppRunner, config: ServeConfig, sock: socket.socket | None = None) -> GuardedSite:
    """Serves `runner` (set up) on `sock`, else on config.host:config.port, behind the connection guard that the
    app's connection middleware also reads."""
    assert runner.server is not None
    guard = runner.app[CONNECTIONS]
    guard.server = runner.server
    sock = sock if sock is not None else bind(config.host, config.port)
    if config.send_buffer_bytes:
        # Accepted connections inherit it: also a socket lent by the launcher or by systemd.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.send_buffer_bytes)
    site = GuardedSite(runner, sock, guard)
    await site.start()
    return site
