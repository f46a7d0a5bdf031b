"""Images answered by URL (`response_format: "url"`, issue 33): each image a file the daemon serves itself at an
expiring, signed URL, as OpenAI answers with URLs of its own.

A URL is `{base}/v1/files/{id}/content?expires=T&signature=S`: the id is 128 random bits, S is HMAC-SHA256 of
"id.T" under a secret (`--url-secret`, else 32 random bytes per start, so that a restart voids the URLs it gave),
compared in constant time. Neither can be guessed or changed: another id, another T or a signature of another
secret is 404, as is a URL after T. The route needs no API key (the signature is the key), so the URL works in a
browser or an `<img>` tag. `base` is `--public-base-url` behind a proxy, else the scheme and Host the request came
with.

The files live in the results folder (`--video-dir`, else a temporary one) under `files/`, bounded like the videos
there (`--video-store-bytes` of them, kept `--video-ttl` seconds; the oldest go first when a new one needs room),
each kind counted apart. Replicas that share a results folder (`--state-url`) each keep their images in a folder
of their own under `files/`, and serve each other's: with one `--url-secret`, a URL any of them signed is valid on
all, and the file is found by its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from diffusiond.daemon.admission import quota_exceeded
from diffusiond.daemon.api import ApiError
from diffusiond.daemon.auth import tenant_of
from diffusiond.daemon.state import ENCODERS, STATE
from diffusiond.daemon.video_store import QuotaFull

log = logging.getLogger(__name__)

MEDIA = {
    "png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4", "wav": "audio/wav",
    "flac": "audio/flac",
}  # fmt: skip
FILE_ID = re.compile(r"file_[0-9a-f]{32}")


@dataclass
class StoredFile:
    id: str
    owner: str
    format: str
    bytes: int
    expires_at: int

    @property
    def name(self) -> str:
        return f"{self.id}.{self.format}"


class FileStore:
    def __init__(
        self, directory: Path, *, max_bytes: int, ttl: float, secret: bytes, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory, self.max_bytes, self.ttl, self.clock = directory, max_bytes, ttl, clock
        self._secret = secret
        self.files: OrderedDict[str, StoredFile] = OrderedDict()
        self.used = 0
        # Bytes the video store holds (all of it, or one tenant's): the budget (--video-store-bytes) and a tenant's
        # max_stored_bytes are shared by its videos and these files (videos_ctx wires it; none in tests of one store).
        self.others_hold: Callable[[str | None], int] = lambda owner: 0
        for stale in directory.glob("file_*"):  # a previous run's: their URLs died with its secret
            stale.unlink(missing_ok=True)

    def held_by(self, owner: str) -> int:
        return sum(f.bytes for f in self.files.values() if f.owner == owner)

    def reserve(self, owner: str, fmt: str, size: int, quota: int | None = None) -> StoredFile:
        """An entry for a file of `size` bytes of tenant `owner`, room made by forgetting the oldest file of the
        tenant that holds the most (its new file counted): one tenant's images push out its own first, never
        another's while it holds more than that one (ValueError if it can never fit). `quota`: the tenant's
        max_stored_bytes, its videos counted, made room in by forgetting its own oldest files (QuotaFull when its
        videos leave no room)."""
        self.sweep()
        budget = self.max_bytes - self.others_hold(None)
        if size > budget:
            raise ValueError(
                f"the image is {size} bytes; this server keeps at most {self.max_bytes} (--video-store-bytes), "
                f"{self.max_bytes - budget} of them taken by videos"
            )
        if quota is not None:
            room = quota - self.others_hold(owner)
            if size > room:
                raise QuotaFull("max_stored_bytes", f"the file is {size} bytes; the tenant may keep {quota}, "
                                f"{quota - room} of them in videos")  # fmt: skip
            while self.held_by(owner) + size > room:
                self.remove(next(f.id for f in self.files.values() if f.owner == owner))
        while self.used + size > budget:
            held = {owner: size}
            for entry in self.files.values():
                held[entry.owner] = held.get(entry.owner, 0) + entry.bytes
            largest = max(held, key=lambda name: held[name])
            oldest = next((f.id for f in self.files.values() if f.owner == largest), None)
            self.remove(oldest if oldest is not None else next(iter(self.files)))
        self.directory.mkdir(parents=True, exist_ok=True)  # at the first image: a video server has none
        entry = StoredFile(f"file_{secrets.token_hex(16)}", owner, fmt, size, int(self.clock() + self.ttl))
        self.files[entry.id] = entry
        self.used += size
        return entry

    def remove(self, file_id: str) -> None:
        entry = self.files.pop(file_id, None)
        if entry is not None:
            self.used -= entry.bytes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / entry.name)

    def sweep(self) -> None:
        now = self.clock()
        for file_id in [f.id for f in self.files.values() if f.expires_at <= now]:
            self.remove(file_id)

    def signature(self, file_id: str, expires: int) -> str:
        return hmac.new(self._secret, f"{file_id}.{expires}".encode(), hashlib.sha256).hexdigest()

    def url(self, base: str, entry: StoredFile) -> str:
        return self.signed(base, entry.id, entry.expires_at)

    def signed(self, base: str, file_id: str, expires: int) -> str:
        """The URL of a file (an image here, or a completed video of the video store) valid until `expires`."""
        return f"{base}/v1/files/{file_id}/content?expires={expires}&signature={self.signature(file_id, expires)}"

    def valid(self, file_id: str, expires: str, signature: str) -> bool:
        """Whether a URL's signature is this store's and its expiry is still ahead."""
        # ASCII only: "²" is a digit to str.isdigit (not to int), and compare_digest refuses other strings.
        if not (expires.isascii() and expires.isdigit()) or len(expires) > 12 or not signature.isascii():
            return False
        return hmac.compare_digest(self.signature(file_id, int(expires)), signature) and int(expires) > self.clock()

    def lookup(self, file_id: str, expires: str, signature: str) -> StoredFile | None:
        """The image a URL names, if the URL is valid and the image still kept."""
        self.sweep()
        return self.files.get(file_id) if self.valid(file_id, expires, signature) else None

    def elsewhere(self, file_id: str, expires: str, signature: str) -> tuple[Path, str] | None:
        """(path, format) of an image another replica sharing the results folder keeps (in a sibling of this
        store's folder), if the URL is valid."""
        if not FILE_ID.fullmatch(file_id) or not self.valid(file_id, expires, signature):
            return None
        with contextlib.suppress(OSError):
            for folder in self.directory.parent.iterdir():
                for fmt in MEDIA:
                    if folder != self.directory and (path := folder / f"{file_id}.{fmt}").is_file():
                        return path, fmt
        return None


def base_url(request: web.Request, configured: str | None) -> str:
    """Where clients reach the daemon: `--public-base-url`, else the scheme and Host of the request."""
    return (configured or f"{request.scheme}://{request.host}").rstrip("/")


def write_file(directory: Path, entry: StoredFile, data: bytes) -> None:
    """The file, written to a temporary name and renamed. Blocking: in the encoder pool."""
    tmp = directory / f"{entry.id}.tmp"
    try:
        tmp.write_bytes(data)
        tmp.rename(directory / entry.name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


FILES = web.AppKey("files", FileStore)


async def store_result(request: web.Request, data: bytes, fmt: str) -> str:
    """An image (or a native stream's clip) kept in the results folder; its signed URL."""
    files, tenant = request.app[FILES], tenant_of(request)
    try:
        entry = files.reserve(tenant.name, fmt, len(data), tenant.max_stored_bytes)
    except ValueError as exc:
        raise ApiError(507, str(exc), type="server_error", code="insufficient_storage") from None
    except QuotaFull as exc:
        raise quota_exceeded(request.app[STATE], tenant, exc.quota, str(exc)) from None
    try:
        await asyncio.get_running_loop().run_in_executor(
            request.app[ENCODERS], write_file, files.directory, entry, data
        )
    except OSError as exc:
        files.remove(entry.id)
        raise ApiError(
            507,
            f"the file could not be stored: {exc.strerror or exc}",
            type="server_error",
            code="insufficient_storage",
        ) from None
    return files.url(base_url(request, request.app[STATE].config.public_base_url), entry)
