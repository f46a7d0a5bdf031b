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
each kind counted apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

log = logging.getLogger(__name__)

MEDIA = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


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
        for stale in directory.glob("file_*"):  # a previous run's: their URLs died with its secret
            stale.unlink(missing_ok=True)

    def reserve(self, owner: str, fmt: str, size: int) -> StoredFile:
        """An entry for a file of `size` bytes, room made by forgetting the oldest (ValueError if it can never fit)."""
        self.sweep()
        if size > self.max_bytes:
            raise ValueError(
                f"the image is {size} bytes; this server keeps at most {self.max_bytes} (--video-store-bytes)"
            )
        while self.used + size > self.max_bytes:
            self.remove(next(iter(self.files)))
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
        if not expires.isdigit() or len(expires) > 12:
            return False
        return hmac.compare_digest(self.signature(file_id, int(expires)), signature) and int(expires) > self.clock()

    def lookup(self, file_id: str, expires: str, signature: str) -> StoredFile | None:
        """The image a URL names, if the URL is valid and the image still kept."""
        self.sweep()
        return self.files.get(file_id) if self.valid(file_id, expires, signature) else None


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
