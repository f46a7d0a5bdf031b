"""The service manager notification protocol (sd_notify(3)), in a few lines instead of a dependency.

Messages are newline-separated `KEY=VALUE` assignments in one datagram to the AF_UNIX socket named by
`$NOTIFY_SOCKET` (a leading '@' means the abstract namespace). Without that variable every call is a no-op, so the
daemon behaves the same outside systemd. Sends never block the event loop: the socket is non-blocking and a message
that cannot be sent is dropped (and logged once).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        if address is not None and not address.startswith(("/", "@")):
            log.warning("ignoring NOTIFY_SOCKET=%r: only paths and abstract ('@') addresses are supported", address)
            address = None
        if address is not None and address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address
        self._sock: socket.socket | None = None
        self._warned = False
        # Ping at half the interval the manager waits for, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Notifier:
        # WATCHDOG_PID is deliberately not checked: under the elastic launcher the process that serves HTTP is a
        # child of the main process, and its event loop is the one whose liveness the watchdog should prove
        # (the unit sets NotifyAccess=all for that reason).
        usec = env.get("WATCHDOG_USEC", "")
        return cls(env.get("NOTIFY_SOCKET") or None, int(usec) if usec.isdigit() and int(usec) > 0 else None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *assignments: str) -> bool:
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(assignments).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("could not notify the service manager at %r: %s", self._address, exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", _status(status))

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", _status(status))

    def status(self, status: str) -> bool:
        return self.send(_status(status))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str) -> str:
    return "STATUS=" + " ".join(text.split())
