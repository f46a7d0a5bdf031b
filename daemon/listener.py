"""The listening socket, held by whatever outlives rank 0, so that a group restart refuses no one.

Under `serve --nproc N` the launcher binds the socket (or takes the one systemd passes, socket activation) before
it starts the group, keeps it for its whole life, and lends it to each rank 0 it starts over a Unix socket
(SCM_RIGHTS: the agent's subprocesses inherit no descriptors). While a group heals no process accepts, and the
kernel keeps new connections in the socket's backlog; the next rank 0 accepts them. A single process (`--nproc 1`)
takes systemd's socket when there is one, else binds its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading

from diffusiond.daemon.connections import bind

log = logging.getLogger(__name__)

# The Unix socket rank 0 asks for the listening socket on (set by the launcher for its workers).
LISTENER_ENV = "_DIFFUSIOND_LISTENER"
# systemd socket activation (sd_listen_fds(3)): descriptors from 3, LISTEN_FDS of them, for LISTEN_PID.
SD_LISTEN_FDS_START = 3


def systemd_socket() -> socket.socket | None:
    """The listening socket systemd passed this process (`diffusiond.socket`), or None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or not os.environ.get("LISTEN_FDS"):
        return None
    count = int(os.environ["LISTEN_FDS"])
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):  # not for our children
        os.environ.pop(name, None)
    if count != 1:
        raise OSError(f"systemd passed {count} sockets; diffusiond.socket listens on one (ListenStream=)")
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.type != socket.SOCK_STREAM:
        raise OSError("the socket systemd passed is not a stream socket (use ListenStream=)")
    return sock


def borrowed_socket() -> socket.socket | None:
    """The launcher's listening socket, when this process is a rank 0 it started; None otherwise."""
    path = os.environ.get(LISTENER_ENV)
    if not path:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(10)
        unix.connect(path)
        _, fds, _, _ = socket.recv_fds(unix, 16, 1)
    if not fds:
        raise OSError(f"the launcher sent no socket on {path}")
    return socket.socket(fileno=fds[0])


def listening_socket(host: str, port: int) -> socket.socket:
    """What this process serves on: the launcher's socket, systemd's, or its own bound to host:port (OSError)."""
    sock = borrowed_socket() or systemd_socket() or bind(host, port)
    sock.setblocking(False)
    return sock


class SocketLender:
    """The launcher's side: holds `sock` and gives a copy of it to each process that connects to `path`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._dir = tempfile.mkdtemp(prefix="diffusiond-listener-")
        self.path = os.path.join(self._dir, "socket")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.path)
        os.chmod(self.path, 0o600)
        self._unix.listen(8)
        self.lent = 0
        self._thread = threading.Thread(target=self._serve, name="diffusiond-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._unix.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    socket.send_fds(conn, [b"listen"], [self.sock.fileno()])
                    self.lent += 1
                except OSError as exc:
                    log.warning("could not hand the listening socket to a rank: %s", exc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._unix.shutdown(socket.SHUT_RDWR)
        self._unix.close()
        self.sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
