"""The listening socket, held by whatever outlives rank 0, so that a group restart refuses no one.

Under `serve --nproc N` the launcher binds the socket (or takes the one systemd passes, socket activation) before
it starts the group, keeps it for its whole life, and lends it to each rank 0 it starts over a Unix socket
(SCM_RIGHTS: the agent's subprocesses inherit no descriptors). With several nodes (`--nnodes`), the launcher whose
node hosts rank 0 binds it when that rank first asks (rank 0's node is known only at the rendezvous; it is the
node whose address sorts first, so the same one at every restart), and keeps it from then on. While a group heals
no process accepts, and the kernel keeps new connections in the socket's backlog; the next rank 0 accepts them. A
single process (`--nproc 1`) takes systemd's socket when there is one, else binds its own.

The launcher also keeps what a failing rank 0 hands it: the connection of a request the group had not started, with
the request itself (daemon/handover.py), given to the next rank 0 with the listening socket. If no rank 0 comes for
them (the launcher stops), each client gets the answer its rank 0 would have sent (503 with Retry-After).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from diffusiond.daemon.connections import bind

log = logging.getLogger(__name__)

# The Unix socket rank 0 asks for the listening socket on (set by the launcher for its workers).
LISTENER_ENV = "_DIFFUSIOND_LISTENER"
# systemd socket activation (sd_listen_fds(3)): descriptors from 3, LISTEN_FDS of them, for LISTEN_PID.
SD_LISTEN_FDS_START = 3
# What the launcher keeps for the next rank 0 at most: requests, and their bytes (bodies carry images).
MAX_CARRIED = 1024
MAX_CARRIED_BYTES = 256 << 20
# One message on the Unix socket: an operation, the length of its payload; a descriptor rides with these bytes.
FRAME = struct.Struct("!cQ")
BORROW, LEND, HAND, CARRY, END, TAKEN, REFUSED = b"B", b"L", b"H", b"C", b"E", b"k", b"n"
TIMEOUT_S = 10.0


class Carried(msgspec.Struct, frozen=True):
    """A request a failed group had not started, kept with its client's connection for the next rank 0."""

    # The request as the next rank 0 reads it: request line, headers, body.
    raw: bytes
    # What its client gets if no rank 0 serves it (a 503, or a stream's `failed` event), framed for its connection.
    fallback: bytes
    # The ids its client was told (its stream had started): the next rank 0 keeps them and sends no second head.
    request_ids: list[str] = []


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


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket a process that owns one serves on: systemd's, or its own bound to host:port (OSError)."""
    sock = systemd_socket() or bind(host, port)
    sock.setblocking(False)
    return sock


@dataclass
class Lent:
    """What a rank 0 under the launcher starts with: the listening socket, and requests carried over a heal."""

    sock: socket.socket
    carried: list[tuple[socket.socket, Carried]] = field(default_factory=list)


def borrow() -> Lent | None:
    """The launcher's listening socket and the requests it keeps, when this process is a rank 0 it started."""
    path = os.environ.get(LISTENER_ENV)
    if not path:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(TIMEOUT_S)
        unix.connect(path)
        _send(unix, BORROW)
        op, payload, fd = _receive(unix)
        if op != LEND or fd is None:
            raise OSError(f"the launcher sent no socket on {path}: {payload.decode(errors='replace') or op}")
        lent = Lent(socket.socket(fileno=fd))
        lent.sock.setblocking(False)
        while (message := _receive(unix))[0] == CARRY:
            _, payload, fd = message
            if fd is not None:
                lent.carried.append((socket.socket(fileno=fd), msgspec.msgpack.decode(payload, type=Carried)))
    return lent


def hand(path: str, connection: int, carried: Carried) -> bool:
    """Rank 0: gives the launcher a client's connection (a descriptor) and its request; whether it took them."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(TIMEOUT_S)
        unix.connect(path)
        _send(unix, HAND, msgspec.msgpack.encode(carried), connection)
        return _receive(unix)[0] == TAKEN


class SocketLender:
    """The launcher's side: holds `sock`, gives a copy of it to each process that connects to `path`, and keeps
    the connections a failing rank 0 hands it until the next one borrows the socket. `sock` may be a function that
    makes it, called at the first borrow: with several nodes only the node whose launcher starts rank 0 listens, and
    which one that is is known at the rendezvous."""

    def __init__(self, sock: socket.socket | Callable[[], socket.socket]) -> None:
        self.sock = sock if isinstance(sock, socket.socket) else None
        self._make = sock if not isinstance(sock, socket.socket) else None
        self._dir = tempfile.mkdtemp(prefix="diffusiond-listener-")
        self.path = os.path.join(self._dir, "socket")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.path)
        os.chmod(self.path, 0o600)
        self._unix.listen(64)
        self.lent = 0
        self.carried: list[tuple[socket.socket, Carried]] = []
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="diffusiond-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._unix.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(TIMEOUT_S)
                try:
                    op, payload, fd = _receive(conn)
                    if op == BORROW:
                        self._lend(conn)
                    elif op == HAND and fd is not None:
                        _send(conn, TAKEN if self._keep(fd, payload) else REFUSED)
                    elif fd is not None:
                        os.close(fd)
                except (OSError, EOFError, msgspec.DecodeError) as exc:
                    log.warning("a rank's request on the launcher's socket failed: %s", exc)

    def _keep(self, fd: int, payload: bytes) -> bool:
        client = socket.socket(fileno=fd)
        with self._lock:
            held = sum(len(c.raw) for _, c in self.carried)
            if self._closing or len(self.carried) >= MAX_CARRIED or held + len(payload) > MAX_CARRIED_BYTES:
                client.close()
                return False
            self.carried.append((client, msgspec.msgpack.decode(payload, type=Carried)))
        return True

    def _lend(self, conn: socket.socket) -> None:
        if self.sock is None:
            try:
                self.sock = self._make()
            except OSError as exc:
                log.error("cannot listen for rank 0: %s", exc)
                _send(conn, REFUSED, str(exc).encode())
                return
            log.info("listening for rank 0, on this node from now on")
        _send(conn, LEND, fd=self.sock.fileno())
        self.lent += 1
        with self._lock:
            carried, self.carried = self.carried, []
        if carried:
            log.info("the next rank 0 takes %d requests the failed group had not started", len(carried))
        try:
            while carried:
                client, item = carried[0]
                _send(conn, CARRY, msgspec.msgpack.encode(item), client.fileno())
                carried.pop(0)[0].close()
            _send(conn, END)
        finally:
            _answer(carried)  # the rank 0 went away while it took them

    def close(self) -> None:
        with self._lock:
            self._closing = True
            carried, self.carried = self.carried, []
        _answer(carried)  # no rank 0 will serve them
        with contextlib.suppress(OSError):
            self._unix.shutdown(socket.SHUT_RDWR)
        self._unix.close()
        if self.sock is not None:
            self.sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _answer(carried: list[tuple[socket.socket, Carried]]) -> None:
    """Each client the answer its rank 0 would have sent, then its connection closed."""
    for client, item in carried:
        with client, contextlib.suppress(OSError):
            client.settimeout(1.0)
            client.sendall(item.fallback)
    carried.clear()


def _send(conn: socket.socket, op: bytes, payload: bytes = b"", fd: int | None = None) -> None:
    head = FRAME.pack(op, len(payload))
    sent = conn.sendall(head) if fd is None else socket.send_fds(conn, [head], [fd])
    if fd is not None and sent < len(head):
        conn.sendall(head[sent:])
    if payload:  # (an empty send to a peer that has answered and closed would be EPIPE)
        conn.sendall(payload)


def _receive(conn: socket.socket) -> tuple[bytes, bytes, int | None]:
    head, fds, _, _ = socket.recv_fds(conn, FRAME.size, 1)
    head += _exactly(conn, FRAME.size - len(head)) if head else b""
    if not head:
        raise EOFError("the other side closed the launcher's socket")
    op, length = FRAME.unpack(head)
    return op, _exactly(conn, length), fds[0] if fds else None


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the launcher's socket closed mid-message")
        data += chunk
    return bytes(data)
