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

A rank 0 keeps the Unix connection it borrowed on open for as long as it accepts; when it lets go (its engine is
gone) or dies, the launcher accepts on the socket itself until the next rank 0 borrows it: it answers the probes
(`/health` 200 and `/ready` 503, `{"status": "restarting"}`, so that a liveness probe does not restart a service that
is healing and a readiness probe sees a 503, not a timeout) and keeps every other connection, with what it has read
of it, for the next rank 0, as it keeps those a failing rank 0 hands it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
# How long the launcher waits for a request head before it keeps the connection as it is for the next rank 0.
HEAD_WAIT_S = 2.0
PROBES = {b"/health": 200, b"/ready": 503, b"/metrics": 503}


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
    """What a rank 0 under the launcher starts with: the listening socket, and requests carried over a heal. `holder`
    is the connection it borrowed on: open while this rank 0 accepts (`release` tells the launcher it no longer
    does; its death closes it too)."""

    sock: socket.socket
    carried: list[tuple[socket.socket, Carried]] = field(default_factory=list)
    holder: socket.socket | None = None

    def release(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None


def served_marker() -> Path | None:
    """A file in the launcher's folder that rank 0 creates once its group is ready (warmed up): a restart of the
    group then knows that this model, layout and node served before (models/loading/setup.py's checks and the warm-up
    passed). None outside our launcher (plain torchrun)."""
    path = os.environ.get(LISTENER_ENV)
    return Path(path).with_name("served") if path else None


def borrow() -> Lent | None:
    """The launcher's listening socket and the requests it keeps, when this process is a rank 0 it started."""
    path = os.environ.get(LISTENER_ENV)
    if not path:
        return None
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        unix.settimeout(TIMEOUT_S)
        unix.connect(path)
        _send(unix, BORROW)
        op, payload, fd = _receive(unix)
        if op != LEND or fd is None:
            raise OSError(f"the launcher sent no socket on {path}: {payload.decode(errors='replace') or op}")
        lent = Lent(socket.socket(fileno=fd), holder=unix)
        lent.sock.setblocking(False)
        while (message := _receive(unix))[0] == CARRY:
            _, payload, fd = message
            if fd is not None:
                lent.carried.append((socket.socket(fileno=fd), msgspec.msgpack.decode(payload, type=Carried)))
    except BaseException:
        unix.close()
        raise
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
        if self.sock is not None:
            self.sock.setblocking(False)  # accepted from the select loop; a rank 0 may take a connection first
        self._make = sock if not isinstance(sock, socket.socket) else None
        self._dir = tempfile.mkdtemp(prefix="diffusiond-listener-")
        self.path = os.path.join(self._dir, "socket")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.path)
        os.chmod(self.path, 0o600)
        self._unix.listen(64)
        self.lent = 0
        self.probes = 0  # probes the launcher answered itself
        self.carried: list[tuple[socket.socket, Carried]] = []
        # The connection of the rank 0 that accepts now (None: none does, the launcher answers the probes).
        self._holder: socket.socket | None = None
        # Connections the launcher accepted, and when it stops waiting for their whole head.
        self._waiting: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="diffusiond-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closing:
            accepting = self.sock is not None and self._holder is None
            readers = [self._unix, *([self._holder] if self._holder else []), *([self.sock] if accepting else [])]
            try:
                ready, _, _ = select.select(readers, [], [], 0.05 if self._waiting else 0.25)
            except (OSError, ValueError):  # closed under it
                continue
            for r in ready:
                try:
                    if r is self._unix:
                        self._on_rank(*self._unix.accept())
                    elif r is self._holder:
                        try:
                            left = not r.recv(1)  # rank 0 never writes here: readable means it let go or died
                        except OSError:
                            left = True
                        if left:
                            log.info("rank 0 let the socket go: the launcher answers the probes until the next one")
                            self._holder.close()
                            self._holder = None
                    elif r is self.sock:
                        client, _ = self.sock.accept()
                        client.setblocking(False)
                        self._waiting[client] = time.monotonic() + HEAD_WAIT_S
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as exc:
                    if r is self._unix:
                        return  # closed
                    log.warning("the launcher's socket: %s", exc)
            for client in list(self._waiting):
                self._look(client)

    def _on_rank(self, conn: socket.socket, _address) -> None:
        conn.settimeout(TIMEOUT_S)
        keep = False
        try:
            op, payload, fd = _receive(conn)
            if op == BORROW:
                keep = self._lend(conn)
            elif op == HAND and fd is not None:
                _send(conn, TAKEN if self._keep(fd, payload) else REFUSED)
            elif fd is not None:
                os.close(fd)
        except (OSError, EOFError, msgspec.DecodeError) as exc:
            log.warning("a rank's request on the launcher's socket failed: %s", exc)
        finally:
            if not keep:
                conn.close()

    def _look(self, client: socket.socket) -> None:
        """A connection the launcher accepted (no rank 0 holds the socket): its head is looked at without reading it
        (MSG_PEEK). A probe is read and answered now; anything else is kept, unread, for the next rank 0, which then
        reads the whole request itself; so is a head that is not whole within HEAD_WAIT_S."""
        try:
            head = client.recv(65536, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            head = None
        except OSError:
            head = b""
        if head == b"":  # gone before it said anything
            del self._waiting[client]
            client.close()
            return
        late = time.monotonic() >= self._waiting[client]
        if head is not None and b"\r\n" in head:
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if method in (b"GET", b"HEAD") and path in PROBES:
                end = head.find(b"\r\n\r\n")
                if end >= 0:
                    del self._waiting[client]
                    self.probes += 1  # before the answer: its client may look at the count once it has it
                    with client, contextlib.suppress(OSError):
                        client.recv(end + 4)  # the head only: a probe has no body
                        client.setblocking(True)
                        client.settimeout(1.0)
                        client.sendall(_probe_answer(PROBES[path], method == b"HEAD"))
                    return
                if not late:
                    return
            late = True
        if late:
            del self._waiting[client]
            item = Carried(raw=b"", fallback=RESTARTING)
            if not self._keep_client(client, item):
                _answer([(client, item)])

    def _keep(self, fd: int, payload: bytes) -> bool:
        client = socket.socket(fileno=fd)
        if not self._keep_client(client, msgspec.msgpack.decode(payload, type=Carried)):
            client.close()
            return False
        return True

    def _keep_client(self, client: socket.socket, item: Carried) -> bool:
        with self._lock:
            held = sum(len(c.raw) for _, c in self.carried)
            if self._closing or len(self.carried) >= MAX_CARRIED or held + len(item.raw) > MAX_CARRIED_BYTES:
                return False
            self.carried.append((client, item))
        return True

    def _lend(self, conn: socket.socket) -> bool:
        """The socket and what was kept for rank 0; whether `conn` is now the holder (open while rank 0 accepts)."""
        if self.sock is None:
            try:
                self.sock = self._make()
                self.sock.setblocking(False)
            except OSError as exc:
                log.error("cannot listen for rank 0: %s", exc)
                _send(conn, REFUSED, str(exc).encode())
                return False
            log.info("listening for rank 0, on this node from now on")
        for client in list(self._waiting):  # heads still arriving, unread: the new rank 0 reads them
            del self._waiting[client]
            if not self._keep_client(client, Carried(raw=b"", fallback=RESTARTING)):
                _answer([(client, Carried(raw=b"", fallback=RESTARTING))])
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
        if self._holder is not None:  # the one before never let go (it hangs): this one accepts now
            self._holder.close()
        conn.setblocking(False)
        self._holder = conn
        return True

    def close(self) -> None:
        with self._lock:
            self._closing = True
            carried, self.carried = self.carried, []
        self._thread.join(2.0)
        waiting = [(c, Carried(raw=b"", fallback=RESTARTING)) for c in self._waiting]
        self._waiting.clear()
        _answer(carried + waiting)  # no rank 0 will serve them
        if self._holder is not None:
            self._holder.close()
        with contextlib.suppress(OSError):
            self._unix.shutdown(socket.SHUT_RDWR)
        self._unix.close()
        if self.sock is not None:
            self.sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _json_answer(status: int, reason: str, body: bytes, head_only: bool = False, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)


def _probe_answer(status: int, head_only: bool) -> bytes:
    reason = "OK" if status == 200 else "Service Unavailable"
    extra = "" if status == 200 else "Retry-After: 1\r\n"
    return _json_answer(status, reason, b'{"status":"restarting"}', head_only, extra)


# What a client the launcher kept gets if no rank 0 comes for it.
RESTARTING = _json_answer(
    503,
    "Service Unavailable",
    b'{"error":{"message":"the server is restarting; try again","type":"server_error","param":null,'
    b'"code":"unavailable"}}',
    extra="Retry-After: 1\r\n",
)


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
