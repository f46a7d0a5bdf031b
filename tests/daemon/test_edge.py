"""The HTTP edge over real sockets (issue 30): browsers (Content-Type, Host, Origin, CORS), bodies refused while they
arrive, a budget of bytes read at once.

Broken on purpose once each: with the Content-Type check off a text/plain POST started a generation (200); with
the Host check off `Host: evil.example` was served; with `request.read()` back in the routes a body declaring
128 MiB got no answer until the timeout and the 8 MiB sent each were buffered."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.request

import aiohttp
import pytest
from procs import rss

from diffusiond.daemon.edge import READ_BUDGET, host_allowed

TIMEOUT = aiohttp.ClientTimeout(total=60)
SMALL = {"prompt": "a red circle", "seed": 1, "width": 64, "height": 64, "num_inference_steps": 2}
JSON_ROUTES = ("/v1/generations", "/v1/images/generations", "/v1/loras", "/v1/images/edits")


def head(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw request (its whole head given), and the answer's status, headers and first body bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/octet-stream"]
)
async def test_a_body_that_is_not_json_is_refused_before_any_work(server, content_type):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for route in JSON_ROUTES:
            async with session.post(
                f"{server.base_url}{route}", data=json.dumps(SMALL), headers={"Content-Type": content_type}
            ) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 415 and error["code"] == "unsupported_media_type", (route, error)
                assert "application/json" in error["message"] and error["param"] == "Content-Type"
        # JSON with its charset, and a script that sends no Content-Type at all, are served.
        async with session.post(
            f"{server.base_url}/v1/images/generations",
            data=json.dumps({"prompt": "a red circle", "size": "64x64"}),
            headers={"Content-Type": "application/json; charset=utf-8"},
        ) as resp:
            assert resp.status == 200, await resp.text()
    body = json.dumps({"prompt": "a red circle", "size": "64x64"}).encode()
    status, _, rest = head(
        server.port,
        b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body,
    )
    assert status == 200, rest
    server.wait_idle()


@pytest.mark.asyncio
@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=x", "text/plain", "application/json"])
async def test_a_route_not_served_is_a_404_in_openai_s_shape_whatever_its_body(server, content_type):
    """OpenAI routes this server does not serve (`/v1/images/variations`) answer 404 in OpenAI's error shape, not a
    415 about the body's type (the edge's check ran before routing: issue 54)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for route in ("/v1/images/variations", "/v1/no-such-route"):
            async with session.post(
                f"{server.base_url}{route}", data=b"--x--", headers={"Content-Type": content_type}
            ) as resp:
                assert resp.status == 404, (route, content_type, await resp.text())
                error = (await resp.json())["error"]
                assert error["message"] and error["type"], error


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trace: a\x00b\r\n",  # a NUL byte in a header
        b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # ... in the path
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX Trace: ab\r\n",  # a space in a header's name
        b"POST /v1/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1x\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # past the request line's limit
    ],
)
def test_a_request_the_parser_refuses_is_an_openai_400_without_a_traceback(server, head, caplog):
    """aiohttp's parser refused these with a plain-text 400 and logged a traceback at ERROR for each."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(head + b"\r\n")
    data = b""
    while chunk := sock.recv(65536):  # the connection closes after the answer
        data += chunk
    sock.close()
    status, _, body = data.partition(b"\r\n\r\n")
    assert status.split()[1] == b"400" and b"application/json" in status, data
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_request" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("malformed request: ") and len(error["message"]) < 160, error
    time.sleep(0.05)  # the log record of the server's thread
    http = [r for r in caplog.records if r.name.startswith(("aiohttp", "diffusiond.daemon.connections"))]
    assert not [r for r in http if r.levelno >= logging.WARNING or r.exc_info], http
    with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=10) as resp:  # and it serves on
        assert resp.status == 200


def test_host_rules():
    assert host_allowed("127.0.0.1:8000", ()) and host_allowed("[::1]:8000", ()) and host_allowed("10.1.2.3", ())
    assert host_allowed("localhost:8000", ()) and host_allowed("app.localhost", ()) and host_allowed(None, ())
    assert not host_allowed("evil.example", ()) and not host_allowed("evil.example:8000", ())
    assert not host_allowed("127.0.0.1.evil.example", ()) and not host_allowed("[::1", ())
    assert host_allowed("diffusiond.svc:80", ("diffusiond.svc",)) and host_allowed("a.example.com", (".example.com",))
    assert host_allowed("example.com", (".example.com",)) and not host_allowed("badexample.com", (".example.com",))
    assert host_allowed("anything.at.all", ("*",))


def test_a_foreign_host_is_refused(serve):
    server = serve(allowed_hosts=("diffusiond.internal",))
    for host, expected in ((b"evil.example", 421), (b"evil.example:80", 421), (b"diffusiond.internal:8000", 200)):
        status, _, body = head(
            server.port, b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
        )
        assert status == expected, (host, body)
    status, _, body = head(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:1\r\nConnection: close\r\n\r\n")
    assert status == 200, body


@pytest.mark.asyncio
async def test_cross_origin_requests_need_a_listed_origin(serve):
    server = serve(cors_origins=("https://app.example.com",))
    url = f"{server.base_url}/v1/images/generations"
    body = {"prompt": "a red circle", "size": "64x64"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(url, json=body, headers={"Origin": "https://evil.example"}) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 403 and error["code"] == "origin_not_allowed", error
            assert "access-control-allow-origin" not in resp.headers
        async with session.post(url, json=body, headers={"Origin": "null"}) as resp:
            assert resp.status == 403
        # The playground's own page: same origin.
        async with session.post(url, json=body, headers={"Origin": server.base_url}) as resp:
            assert resp.status == 200, await resp.text()
        preflight = {
            "Origin": "https://app.example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization",
        }
        async with session.options(url, headers=preflight) as resp:
            assert resp.status == 204, await resp.text()
            assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert "Content-Type" in resp.headers["Access-Control-Allow-Headers"]
        async with session.post(url, json=body, headers={"Origin": "https://app.example.com"}) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        async with session.options(url, headers={**preflight, "Origin": "https://evil.example"}) as resp:
            assert resp.status == 403


def test_a_body_declared_too_large_is_refused_before_it_is_read(server):
    """32 clients at once, each declaring 128 MiB and sending 8 MiB of it: each gets its 413 at once, and what
    they sent is not kept (RSS)."""
    clients, sent = 32, 8 << 20
    payload = b"x" * (1 << 20)
    before = rss()
    answers: list[tuple[int, float]] = []
    lock = threading.Lock()

    def client(route: bytes) -> None:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        t0 = time.monotonic()
        sock.sendall(
            b"POST " + route + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(128 << 20).encode() + b"\r\n\r\n"
        )
        writer = threading.Thread(target=_write, args=(sock, payload, sent // len(payload)), daemon=True)
        writer.start()
        data = b""
        try:
            while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
                data += chunk
        except OSError:
            pass  # a reset before the answer: counted as no answer
        with lock:
            answers.append((int(data.split()[1]) if data.startswith(b"HTTP") else 0, time.monotonic() - t0))
        writer.join(10)
        sock.close()

    routes = [b"/v1/generations", b"/v1/images/generations", b"/v1/videos", b"/v1/loras"]
    threads = [threading.Thread(target=client, args=(routes[i % len(routes)],)) for i in range(clients)]
    peak = before
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss())
        time.sleep(0.01)
    assert len(answers) == clients and all(status == 413 for status, _ in answers), answers
    assert max(took for _, took in answers) < 2.0, answers
    assert peak - before < 200 << 20, (before, peak)
    server.wait_until(lambda: server.call(lambda: server.app[READ_BUDGET].reading) == 0, 5, "the budget back")


def _write(sock: socket.socket, chunk: bytes, times: int) -> None:
    try:
        for _ in range(times):
            sock.sendall(chunk)
    except OSError:
        pass  # the server answered and closed: what a client sees after a 413


def test_a_chunked_body_is_cut_at_the_route_limit(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"x" * (256 << 10)
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    writer = threading.Thread(target=_write, args=(sock, frame, 64), daemon=True)  # 16 MiB, limit 1 MiB
    t0 = time.monotonic()
    writer.start()
    data = b""
    while b"\r\n\r\n" not in data and (part := sock.recv(4096)):
        data += part
    assert data.startswith(b"HTTP/1.1 413"), data
    assert time.monotonic() - t0 < 5
    writer.join(10)
    sock.close()


def test_bodies_past_the_read_budget_wait_for_none(serve):
    """Budget 1 MiB, counted as bodies arrive: one client has sent 900 KB of a body and waits; a second body that
    would pass the budget is a 503 with Retry-After, and is served once the first is read."""
    server = serve(max_reading_bytes=1 << 20)
    body = json.dumps({"prompt": "a red circle", "size": "64x64"}).encode()
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    slow.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\nConnection: close\r\n\r\n" + b" " * 900_000
    )
    server.wait_until(lambda: server.call(lambda: server.app[READ_BUDGET].reading) == 900_000, 5, "the slow body")
    second = b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    padded = body + b" " * 200_000
    status, headers, rest = head(
        server.port,
        second + b"Content-Length: " + str(len(padded)).encode() + b"\r\nConnection: close\r\n\r\n" + padded,
    )
    assert status == 503 and headers["retry-after"] == "1" and b"server_busy" in rest, rest
    slow.sendall(body.ljust(100_000))  # the slow body ends: its request runs
    data = b""
    while chunk := slow.recv(65536):
        data += chunk
    slow.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    status, _, _ = head(
        server.port,
        second + b"Content-Length: " + str(len(padded)).encode() + b"\r\nConnection: close\r\n\r\n" + padded,
    )
    assert status == 200
    server.wait_idle()


def test_bodies_that_trickle_are_cut_and_hold_nobody_up(server, tmp_path):
    """40 connections declare 22 MiB bodies and send a byte a second. Counted by declared lengths and with no
    deadline, a dozen of them held the whole read budget for as long as they liked and every other large body got
    503. Now: a generation and an edit with a 15 MiB image from another client are answered meanwhile within
    twice their idle latency, every trickler is cut with 408 once its body falls behind --min-body-rate (after
    5 s: byte k due by 5 + k / rate), and the budget is back to zero."""
    import numpy as np
    from PIL import Image

    assert server.config.min_body_rate == 32 << 10  # the default
    rng = np.random.default_rng(0)
    big = tmp_path / "big.png"
    Image.fromarray(rng.integers(0, 256, (1980, 1980, 4), dtype=np.uint8)).save(big, compress_level=0)
    image = big.read_bytes()
    assert 14 << 20 < len(image) < 16 << 20

    def generation() -> float:
        t0 = time.monotonic()
        status, _, rest = head(
            server.port,
            b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: 56\r\n\r\n"
            + json.dumps({"prompt": "a red circle", "size": "64x64", "seed": 1}).encode().ljust(56),
        )
        assert status == 200, rest
        return time.monotonic() - t0

    def edit() -> float:
        boundary = b"xYz"
        form = b"".join(
            b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"" + name + b"\"" + extra + b"\r\n\r\n"
            + value + b"\r\n"
            for name, extra, value in (
                (b"prompt", b"", b"a red circle"), (b"size", b"", b"64x64"), (b"strength", b"", b"0.5"),
                (b"image", b"; filename=\"big.png\"\r\nContent-Type: image/png", image),
            )
        ) + b"--" + boundary + b"--\r\n"  # fmt: skip
        t0 = time.monotonic()
        status, _, rest = head(
            server.port,
            b"POST /v1/images/edits HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: multipart/form-data; boundary=" + boundary + b"\r\n"
            b"Content-Length: " + str(len(form)).encode() + b"\r\n\r\n" + form,
        )
        assert status == 200, rest
        return time.monotonic() - t0

    idle = (min(generation() for _ in range(3)), min(edit() for _ in range(3)))
    tricklers = []
    for n in range(40):
        # The largest bodies the routes take: the native stream's JSON with base64 images (22 MiB), an edit's form.
        route, kind, declared = (
            (b"/v1/images/edits", b"multipart/form-data; boundary=xYz", 20 << 20) if n % 2
            else (b"/v1/generations", b"application/json", 22 << 20)
        )  # fmt: skip
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST " + route + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: " + kind
                     + b"\r\nContent-Length: " + str(declared).encode() + b"\r\n\r\n")  # fmt: skip
        tricklers.append(sock)
    t0 = time.monotonic()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            for sock in tricklers:
                with contextlib.suppress(OSError):
                    sock.send(b"-" if sock.fileno() != -1 else b"")
            stop.wait(1.0)

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        time.sleep(1.0)
        meanwhile = (generation(), edit())
        answers = []  # (status, seconds until it came): the connection closes 2 s later (aiohttp's lingering)
        deadline = t0 + 15  # all of them: a server that never cuts them fails the test in 15 s, not 40 x 30
        for sock in tricklers:
            data = b""
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
                    data += chunk
            answers.append((data.split(b" ", 2)[1] if data.startswith(b"HTTP") else b"", time.monotonic() - t0))
    finally:
        stop.set()
        feeder.join(5)
        for sock in tricklers:
            sock.close()
    print(f"idle {idle}, beside 40 tricklers {meanwhile}; tricklers cut within {max(t for _, t in answers):.1f} s")
    assert meanwhile[0] < 2 * idle[0] + 0.05 and meanwhile[1] < 2 * idle[1] + 0.05, (idle, meanwhile)
    assert [status for status, _ in answers] == [b"408"] * 40, answers
    assert max(t for _, t in answers) < 5.0 + 1.5, answers  # the grace, and a trickle's second
    server.wait_until(lambda: server.call(lambda: server.app[READ_BUDGET].reading) == 0, 5, "the budget back")
