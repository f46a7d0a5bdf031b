"""A real PostgreSQL server for tests (Debian's `postgresql` package; `.ci/run` installs it): a cluster of its own
in a temporary folder, on a free loopback port, with trust authentication, run as the `postgres` user when the
tests run as root (PostgreSQL refuses root). Each test gets a database of its own (`database`).

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from pg import ...`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from diffusiond.daemon.launch import free_port


def binaries() -> Path | None:
    """Debian's server binaries (initdb and postgres are not on PATH there)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class Postgres:
    def __init__(self) -> None:
        bin_dir = binaries()
        assert bin_dir is not None, "needs Debian's postgresql (.ci/run installs it)"
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="diffusiond-pg-"))
        self.data = self.folder / "data"
        as_root = os.geteuid() == 0
        user = pwd.getpwnam("postgres") if as_root else None
        if user is not None:
            os.chown(self.folder, user.pw_uid, user.pw_gid)

        # The user switch done by subprocess itself, in C between fork and exec: never a `preexec_fn`, whose Python
        # code in the forked child of a threaded process (an xdist worker: execnet's and torch's threads) can block
        # for good on a lock another thread held at the fork (it hung a CI run for 10 minutes in initdb's fork).
        self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user is not None else {}
        subprocess.run(
            [bin_dir / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"],
            check=True,
            capture_output=True,
            **self._as,
        )
        self.log = open(self.folder / "server.log", "w")  # noqa: SIM115 - closed in stop()
        self.bin_dir = bin_dir
        self._start()

    def _start(self) -> None:
        bin_dir = self.bin_dir
        self.proc = subprocess.Popen(
            [bin_dir / "postgres", "-D", self.data, "-p", str(self.port), "-h", "127.0.0.1",
             "-k", self.folder, "-c", "fsync=off", "-c", "max_connections=50"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            **self._as,
        )  # fmt: skip
        self._wait()

    def _wait(self, within: float = 30.0) -> None:
        import psycopg

        deadline = time.monotonic() + within
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "PostgreSQL did not start"
                time.sleep(0.1)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def halt(self) -> None:
        """Stops the server (a restart's first half, or a failover): clients' connections break."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(20)

    def resume(self) -> None:
        """Starts it again on the same data, port and folder."""
        self._start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # fast shutdown: SIGTERM's smart one waits for every client to leave
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
