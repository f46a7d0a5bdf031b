"""The sd_notify protocol over NOTIFY_SOCKET: path and abstract sockets, the watchdog interval, and no-ops."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

import pytest

from diffusiond.daemon.notify import Notifier


@pytest.fixture
def receiver():
    with tempfile.TemporaryDirectory(prefix="diffusiond-notify-") as d:
        path = os.path.join(d, "notify.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            sock.settimeout(5)
            yield path, sock


def test_messages_over_a_path_socket(receiver):
    path, sock = receiver
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("ready: serving x\non 127.0.0.1:8000")
    assert sock.recv(4096) == b"READY=1\nSTATUS=ready: serving x on 127.0.0.1:8000"
    assert notifier.stopping("draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    notifier.close()


def test_messages_over_an_abstract_socket():
    name = f"diffusiond-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.status("loading")
        assert sock.recv(4096) == b"STATUS=loading"
        notifier.close()


def test_without_a_service_manager_everything_is_a_no_op():
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    assert not notifier.ready("ready")
    assert not notifier.watchdog()


def test_watchdog_interval_is_half_of_watchdog_usec():
    assert Notifier.from_env({"WATCHDOG_USEC": "30000000"}).watchdog_interval == 15.0
    assert Notifier.from_env({"WATCHDOG_USEC": "0"}).watchdog_interval is None
    assert Notifier.from_env({"WATCHDOG_USEC": "soon"}).watchdog_interval is None


def test_a_socket_nobody_listens_on_is_not_an_error(tmp_path, caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not notifier.ready("ready")
    assert not notifier.watchdog()
    # Logged once, not on every watchdog ping.
    assert sum("could not notify" in r.getMessage() for r in caplog.records) == 1
    notifier.close()
