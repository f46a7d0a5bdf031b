"""Requests carried over a heal, piece by piece over real sockets (the whole heal: tests/spmd/test_serve_ranks.py).

The launcher keeps a client's connection that a failing rank 0 hands it, open, and gives it to the next rank 0 with
the request; if none comes, the client gets the answer its rank 0 would have sent. The request sent again reads as
the one the client sent, forms included.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from diffusiond.daemon import handover, listener
from diffusiond.daemon.edge import READ_BUDGET, SENT, ReadBudget, read_body, read_form
from diffusiond.daemon.listener import LISTENER_ENV, Carried, SocketLender, borrow, hand


@pytest.fixture
def lender():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        lender = SocketLender(sock.dup())
    yield lender
    lender.close()


@pytest.fixture
def rank0(lender, monkeypatch) -> listener.Lent:
    """A rank 0 that borrowed the socket and holds it (the launcher does not accept meanwhile)."""
    monkeypatch.setenv(LISTENER_ENV, lender.path)
    lent = borrow()
    assert lent is not None
    lent.sock.setblocking(True)
    yield lent
    lent.release()
    lent.sock.close()


def connected(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def test_the_launcher_keeps_a_handed_connection_open_for_the_next_rank_0(lender, rank0):
    client, accepted = connected(rank0.sock)
    with accepted:
        client.sendall(b"POST / HTTP/1.1\r\n\r\n")
        assert hand(lender.path, accepted.fileno(), Carried(b"the request", b"503", ["a"]))
    # The failing rank 0 closed its copy: the client's connection is still open (no EOF, no reset).
    client.settimeout(0.3)
    with pytest.raises(TimeoutError):
        client.recv(1)
    rank0.release()
    lent = borrow()
    assert lent is not None and lent.sock.getsockname() == lender.sock.getsockname()
    ((sock, item),) = lent.carried
    assert item == Carried(b"the request", b"503", ["a"])
    with sock, lent.sock:
        sock.sendall(b"the answer")
        client.settimeout(5)
        assert client.recv(100) == b"the answer"
    # Given once: the next borrower finds none.
    lent.release()
    again = borrow()
    assert again is not None and again.carried == []
    again.release()
    again.sock.close()
    client.close()


def test_a_launcher_that_stops_sends_what_the_rank_0_would_have_sent(lender, rank0):
    client, accepted = connected(rank0.sock)
    with accepted:
        assert hand(lender.path, accepted.fileno(), Carried(b"req", b"HTTP/1.1 503 Service Unavailable\r\n\r\n"))
    lender.close()
    client.settimeout(5)
    assert client.recv(100) == b"HTTP/1.1 503 Service Unavailable\r\n\r\n"
    assert client.recv(100) == b""  # and closed
    client.close()


def test_the_launcher_keeps_a_bounded_number(lender, rank0, monkeypatch):
    monkeypatch.setattr(listener, "MAX_CARRIED", 1)
    first, accepted = connected(rank0.sock)
    second, accepted2 = connected(rank0.sock)
    with first, second, accepted, accepted2:
        assert hand(lender.path, accepted.fileno(), Carried(b"1", b""))
        assert not hand(lender.path, accepted2.fileno(), Carried(b"2", b""))


def test_while_no_rank_0_accepts_the_launcher_answers_the_probes_and_keeps_the_rest(lender, rank0, monkeypatch):
    """Between a rank 0 that let go (its engine is gone, or it died) and the next one, the probes get an answer
    (before: no answer at all, a timeout, for the whole heal) and every other request waits, unread, for the next
    rank 0; a request whose head is not whole after HEAD_WAIT_S waits the same way."""
    monkeypatch.setattr(listener, "HEAD_WAIT_S", 0.3)
    port = lender.sock.getsockname()[1]
    rank0.release()
    ready = request(port, b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ready.startswith(b"HTTP/1.1 503 ") and ready.endswith(b'{"status":"restarting"}'), ready
    assert b"Retry-After: 1" in ready
    assert request(port, b"GET /health?probe=1 HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 OK")
    assert request(port, b"HEAD /ready HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\n")
    assert lender.probes == 3
    api = socket.create_connection(("127.0.0.1", port))
    api.sendall(b"POST /v1/generations HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET /v1/mod")  # a head in pieces: not whole within HEAD_WAIT_S
    deadline = time.monotonic() + 5
    while len(lender.carried) < 2:
        assert time.monotonic() < deadline, lender.carried
        time.sleep(0.05)
    lent = borrow()
    assert lent is not None
    # Looked at, never read: the next rank 0 reads each request whole from its connection.
    assert [item.raw for _, item in lent.carried] == [b"", b""]
    unread = sorted(sock.recv(4096) for sock, _ in lent.carried)
    assert unread == [b"GET /v1/mod", b"POST /v1/generations HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"]
    for sock, _ in lent.carried:
        sock.close()
    # Held again: the launcher answers nothing itself.
    api.settimeout(1)
    probe = socket.create_connection(("127.0.0.1", port))
    probe.sendall(b"GET /ready HTTP/1.1\r\n\r\n")
    probe.settimeout(0.5)
    with pytest.raises(TimeoutError):
        probe.recv(1)
    assert lender.probes == 3
    for sock in (api, slow, probe):
        sock.close()
    lent.release()
    lent.sock.close()


@pytest.mark.asyncio
async def test_a_request_sent_again_reads_as_the_client_sent_it():
    """What the next rank 0 reads (handover._raw) parses to the same fields and files, for a JSON body and for a
    multipart form (re-encoded from its parts, as read)."""
    seen: list[dict] = []

    async def echo(request: web.Request) -> web.Response:
        if request.content_type == "multipart/form-data":
            fields, files = await read_form(request, {"image": 2, "mask": 1}, 1 << 20, aliases={"image[]": "image"})
            seen.append({"fields": fields, "files": {k: [f.hex() for f in v] for k, v in files.items()}})
        else:
            seen.append({"body": (await read_body(request, 1 << 20)).decode()})
        seen[-1]["auth"] = request.headers.get("Authorization")
        body = handover._encoded(request[SENT])
        assert body is not None
        return web.Response(body=handover._raw(request, *body))

    app = web.Application()
    app[READ_BUDGET] = ReadBudget(1 << 30)
    app.router.add_post("/v1/x", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        form = aiohttp.FormData()
        form.add_field("prompt", "a red circle")
        form.add_field("image[]", b"\x89PNG one", filename="a.png", content_type="image/png")
        form.add_field("image[]", b"\x89PNG two", filename="b.png", content_type="image/png")
        form.add_field("mask", b"\x00mask", filename="m.png")
        headers = {"Authorization": "Bearer k"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            for data in (json.dumps({"prompt": "x", "n": 2}), form):
                async with session.post(f"http://127.0.0.1:{port}/v1/x?q=1", data=data, headers=headers) as resp:
                    raw = await resp.read()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(raw)
                await writer.drain()
                assert b" 200 " in await reader.readline()
                writer.close()
                await writer.wait_closed()
                assert seen[-1] == seen[-2], seen
        assert seen[3]["files"]["image"] == [b"\x89PNG one".hex(), b"\x89PNG two".hex()]
    finally:
        await runner.cleanup()


class _Transport:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data) -> None:
        self.data += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_a_carried_stream_gets_no_second_head():
    inner = _Transport()
    t = handover._HeadSent(inner, b"fallback")
    t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
    t.writelines([b"Transfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n"])
    t.write(b"0\r\n\r\n")
    assert inner.data == b"5\r\nhello\r\n0\r\n\r\n" and not inner.closed
    # The next rank 0 cannot serve it (its model did not come back): the event the failing rank 0 would have sent.
    inner = _Transport()
    handover._HeadSent(inner, b"fallback").write(b"HTTP/1.1 503 Service Unavailable\r\n\r\n{}")
    assert inner.data == b"fallback" and inner.closed
