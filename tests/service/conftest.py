"""The daemon as a real subprocess (`python -m diffusiond serve`), and a notification socket that a test owns in the
role of the service manager (`NOTIFY_SOCKET`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 60.0


class NotifyListener:
    """An AF_UNIX datagram socket that collects sd_notify messages in a background thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.05)
        self._messages: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, name="notify-listener", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self._messages.append(data.decode())
                self._cond.notify_all()

    @property
    def messages(self) -> list[str]:
        with self._cond:
            return list(self._messages)

    def assignments(self) -> list[str]:
        """Every KEY=VALUE line received so far, in order."""
        return [line for message in self.messages for line in message.split("\n")]

    def wait_for(self, line: str, timeout: float, count: int = 1) -> list[str]:
        """Waits until `count` received lines start with `line`; returns the lines so far."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                lines = [x for m in self._messages for x in m.split("\n")]
                if sum(x.startswith(line) for x in lines) >= count:
                    return lines
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {line!r} (x{count}) within {timeout}s; got {lines}")
                self._cond.wait(left)

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self._sock.close()


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    notify: NotifyListener
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait_ready(self) -> None:
        try:
            self.notify.wait_for("READY=1", START_TIMEOUT_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- daemon log ---\n{self.log()}") from None

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon still running after {timeout}s\n--- daemon log ---\n{self.log()}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start_daemon(tiny_sd3, tmp_path) -> Iterator[Callable[..., Daemon]]:
    """start_daemon(*flags) -> a `diffusiond serve` subprocess on the tiny checkpoint, notifying a test socket
    with the watchdog on (WATCHDOG_USEC=200000, so pings every 0.1 s). Killed at teardown if still running."""
    started: list[Daemon] = []
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer.
    sock_dir = tempfile.mkdtemp(prefix="diffusiond-notify-")

    def start(*flags: str, open_files: int | None = None) -> Daemon:
        """`open_files`: the daemon's soft and hard RLIMIT_NOFILE (as a unit's LimitNOFILE sets them)."""
        notify = NotifyListener(os.path.join(sock_dir, f"{len(started)}.sock"))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSIOND_")}
        env.update(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="200000", PYTHONUNBUFFERED="1")
        log_path = tmp_path / f"daemon{len(started)}.log"
        argv = [sys.executable, "-m", "diffusiond", "serve", "--model", tiny_sd3, "--port", str(port), "--threads", "1"]
        # Tests run long requests (1000 steps) to act on them mid-flight.
        argv += ["--max-steps", "1000"]
        if open_files is not None:
            argv = ["sh", "-c", f'ulimit -n {open_files} && exec "$@"', "sh", *argv]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*argv, *flags],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        daemon = Daemon(proc, port, notify, log_path)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(10)
        daemon.notify.close()
    for name in os.listdir(sock_dir):
        os.unlink(os.path.join(sock_dir, name))
    os.rmdir(sock_dir)
