"""The HTTP edge, before any route runs: who may call from a browser (Host, Origin, CORS, Content-Type), and bodies
read against their route's limit and a budget of bytes being read at once.

A page the operator opens in a browser may send requests to the loopback daemon: a "simple" POST (text/plain, a
form) needs no preflight, and a DNS rebinding name can make the page same-origin with it. So a body must say it is
JSON (or a multipart form where a route takes one), a `Host` must be an address or a name the operator allows, and
an `Origin` other than the daemon's own must be listed in `--cors-origins`.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from diffusiond.daemon.api import ApiError, retry_later, too_large
from diffusiond.daemon.config import ServeConfig

# Names that always mean this machine; any IP literal is also fine (rebinding needs a name).
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})
JSON_TYPES = frozenset({"application/json"})
FORM_TYPE = "multipart/form-data"
# Routes that take a multipart form besides (or instead of) JSON.
FORM_ROUTES = frozenset({"/v1/images/edits", "/v1/videos"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CHUNK = 1 << 16
T = TypeVar("T")


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """`host`: a Host header (name or address, with or without a port). True for IP literals, local names, and
    names in `allowed` ("*": any; ".example.com": it and its subdomains)."""
    if not host:
        return True  # HTTP/1.0 clients; a browser always sends one
    name = _hostname(host)
    if name is None:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name in LOCAL_NAMES or name.endswith(".localhost"):
        return True
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or name == entry or (entry.startswith(".") and (name.endswith(entry) or name == entry[1:])):
            return True
    return False


def _hostname(host: str) -> str | None:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


def edge_middleware(config: ServeConfig):
    """Host, Origin and Content-Type checks, and CORS for the origins the operator lists."""
    allowed_hosts = config.allowed_hosts
    cors = frozenset(origin.rstrip("/") for origin in config.cors_origins)

    @web.middleware
    async def edge(request: web.Request, handler) -> web.StreamResponse:
        if not host_allowed(request.headers.get("Host"), allowed_hosts):
            raise ApiError(
                421,
                f"Host {request.headers.get('Host')!r} is not this server's; list the name in --allowed-hosts",
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        listed = origin is not None and origin.rstrip("/") in cors
        if origin is not None and not listed and not _same_origin(request, origin):
            raise ApiError(
                403,
                f"cross-origin request from {origin!r} refused; list the origin in --cors-origins to allow it",
                code="origin_not_allowed",
            )
        if request.method == "OPTIONS" and listed and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers=_cors_headers(origin, preflight=True))
        if request.method in BODY_METHODS and request.match_info.http_exception is None:
            check_content_type(request)  # a route not served answers 404 (405) whatever its body
        response = await handler(request)
        if listed and not response.prepared:
            response.headers.update(_cors_headers(origin))
        return response

    return edge


def _same_origin(request: web.Request, origin: str) -> bool:
    host = request.headers.get("Host")
    return host is not None and origin.lower() in (f"http://{host.lower()}", f"https://{host.lower()}")


def _cors_headers(origin: str, *, preflight: bool = False) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers |= {
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": CORS_HEADERS,
            "Access-Control-Max-Age": "600",
        }
    return headers


def check_content_type(request: web.Request) -> None:
    """A body is JSON, or a multipart form on the routes that take one. No Content-Type at all is taken as JSON (a
    browser always sends one; scripts often do not)."""
    if "Content-Type" not in request.headers and not request.body_exists:
        return
    given = request.content_type if "Content-Type" in request.headers else None
    if given is None or given in JSON_TYPES or given.endswith("+json"):
        return
    forms = request.path in FORM_ROUTES
    if forms and given == FORM_TYPE:
        return
    takes = "application/json" + (" or multipart/form-data (curl -F)" if forms else "")
    raise ApiError(
        415,
        f"Content-Type {given!r} is not taken here: send {takes} (curl --json, or -H 'Content-Type: application/json')",
        param="Content-Type",
        code="unsupported_media_type",
    )


class ReadBudget:
    """Bytes of request bodies held while they are read, over all requests: what has arrived, not what a body
    declares. Beyond it the body that would pass it is refused (503, Retry-After) instead of read: 64 clients sending
    their largest body together must not take the memory. And each body must arrive at `min_rate` bytes a second on
    average after its first BODY_GRACE_S (byte k by then + k / min_rate), or it is cut (408): counted by declared
    lengths and with no deadline, a dozen clients declaring 22 MiB and sending a byte a second held the whole
    budget for as long as they liked, and every other body that needed it got 503."""

    def __init__(self, limit: int, min_rate: int = 0) -> None:
        self.limit = limit
        self.min_rate = min_rate
        self.reading = 0

    def take(self, size: int) -> None:
        if self.reading and self.reading + size > self.limit:
            raise retry_later(
                f"the server is reading {self.reading} bytes of other bodies; try again (--max-reading-bytes)",
                "server_busy",
            )
        self.reading += size

    def release(self, size: int) -> None:
        self.reading -= size


READ_BUDGET = web.AppKey("read_budget", ReadBudget)
# Seconds a body may take before its average rate is held to `ReadBudget.min_rate`.
BODY_GRACE_S = 5.0


class BodyReading:
    """One body being read: each wait for more of it has its deadline (`ReadBudget`), and what has arrived is
    counted against the budget as it arrives, returned at `release`."""

    def __init__(self, request: web.Request) -> None:
        self.content = request.content
        self.budget = request.app[READ_BUDGET]
        self.start = asyncio.get_running_loop().time()
        self.counted = 0

    async def wait(self, read: Awaitable[T]) -> T:
        """`read` (a read of the body) within the body's deadline; then what has arrived is counted."""
        rate = self.budget.min_rate
        if rate > 0:
            due = self.start + BODY_GRACE_S + (self.content.total_bytes + 1) / rate
            try:
                async with asyncio.timeout_at(due):
                    result = await read
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body arrived slower than {rate} bytes a second (--min-body-rate): "
                    f"{self.content.total_bytes} bytes in {asyncio.get_running_loop().time() - self.start:.0f} s",
                    code="body_too_slow",
                    close=True,
                ) from None
        else:
            result = await read
        if (arrived := self.content.total_bytes) > self.counted:
            self.budget.take(arrived - self.counted)
            self.counted = arrived
        return result

    def release(self) -> None:
        self.budget.release(self.counted)
        self.counted = 0


@dataclass(frozen=True)
class SentBody:
    """What the client sent, as read: a body as it was, or a form's fields and files by name. Kept on the request
    so that a request its group never started can be sent to the next rank 0 (daemon/handover.py)."""

    data: bytes | None = None
    fields: dict[str, str] | None = None
    files: dict[str, list[bytes]] | None = None


SENT = web.RequestKey("sent_body", SentBody)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, read as it arrives: 413 as soon as its declared length or the bytes so far pass `limit`, without
    reading the rest; held against the app's read budget, and within its deadline, while it is read
    (`BodyReading`)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit)
    reading = BodyReading(request)
    data = bytearray()
    try:
        while chunk := await reading.wait(request.content.read(CHUNK)):
            data += chunk
            if len(data) > limit:
                raise too_large(limit)
    finally:
        reading.release()
    body = bytes(data)
    request[SENT] = SentBody(data=body)
    return body


# A multipart body: its text fields are short (the longest, a prompt, is 10,000 characters), its files few; anything
# more is refused as it arrives, so no body is read whole.
MAX_FORM_PARTS = 64
MAX_FIELD_BYTES = 64 << 10
# A part's headers and boundary.
FORM_OVERHEAD = 4 << 10


async def read_form(
    request: web.Request, files: dict[str, int], file_bytes: int, *, aliases: dict[str, str] | None = None
) -> tuple[dict[str, str], dict[str, list[bytes]]]:
    """A multipart/form-data body, part by part: its text fields, and its files by name (at most `files[name]` of
    each, of at most `file_bytes` all together; `aliases` maps other part names onto them, as `image[]` onto `image`).
    ApiError (400) names the part that breaks a limit; 413 for a body declared larger than its parts may be. Held
    against the read budget, and within its deadline, while it is read (`BodyReading`)."""
    limit = file_bytes + MAX_FORM_PARTS * (MAX_FIELD_BYTES + FORM_OVERHEAD)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit)
    reading = BodyReading(request)
    try:
        fields, found = await _read_parts(request, reading, files, file_bytes, aliases or {})
    finally:
        reading.release()
    request[SENT] = SentBody(fields=fields, files=found)
    return fields, found


async def _read_parts(
    request: web.Request, reading: BodyReading, files: dict[str, int], file_bytes: int, aliases: dict[str, str]
) -> tuple[dict[str, str], dict[str, list[bytes]]]:
    fields: dict[str, str] = {}
    found: dict[str, list[bytes]] = {name: [] for name in files}
    left = file_bytes
    try:
        reader = await request.multipart()
        for _ in range(MAX_FORM_PARTS + 1):
            part = await reading.wait(reader.next())
            if part is None:
                break
            if not isinstance(part, BodyPartReader) or not part.name:
                raise ApiError(400, "every multipart part must be a named field", code="invalid_multipart")
            name = aliases.get(part.name, part.name)
            if name in found:
                found[name].append(
                    await _read_part(reading, part, name, left, "all files together (--max-image-bytes)")
                )
                left -= len(found[name][-1])
                if len(found[name]) > files[name]:
                    raise ApiError(400, f"send at most {files[name]} {name} file(s) per request", param=name)
            elif name in fields:
                raise ApiError(400, f"{name} is sent twice", param=name)
            else:
                try:
                    fields[name] = (await _read_part(reading, part, name, MAX_FIELD_BYTES)).decode()
                except UnicodeDecodeError:
                    raise ApiError(400, f"{name} is not UTF-8 text", param=name) from None
        else:
            raise ApiError(400, f"more than {MAX_FORM_PARTS} multipart parts", code="invalid_multipart")
    except (ValueError, HttpProcessingError) as exc:  # aiohttp's words for a malformed multipart body
        raise ApiError(400, f"malformed multipart body: {exc}", code="invalid_multipart") from None
    return fields, found


async def _read_part(reading: BodyReading, part: BodyPartReader, name: str, limit: int, what: str = "") -> bytes:
    data = bytearray()
    while chunk := await reading.wait(part.read_chunk(1 << 16)):
        data += chunk
        if len(data) > limit:
            what = f" ({what})" if what else ""
            raise ApiError(400, f"{name} is larger than the {limit} bytes left{what}", param=name, code="too_large")
    return bytes(data)
