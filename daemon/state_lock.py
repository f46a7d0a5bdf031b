"""One daemon per `--state-dir`: its jobs' SQLite database and videos are this daemon's alone (replicas share jobs
through `--state-url`, each under its own replica name). Two daemons given one folder both called themselves `local`,
took each other's running jobs at start and wrote the same files; now the second exits 2 naming the first.

The lock is `flock` on DIR/diffusiond.lock, held by the process that runs for the daemon's life (the one process, or
the launcher of its ranks; under torchrun, rank 0), released by the kernel when that process ends however it ends
(a kill -9 leaves no stale lock). The file holds the holder's pid, for the message."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_NAME = "diffusiond.lock"

# The held lock's file, for the process's life (closing it would release the lock).
_held: IO[str] | None = None


class StateDirBusy(Exception):
    """Another live process holds the folder's lock."""


def lock_state_dir(folder: str) -> None:
    """Takes `folder`'s lock for this process (creating the folder), or raises StateDirBusy naming the holder's
    pid. Taking it again in the process that holds it does nothing."""
    global _held
    path = Path(folder) / LOCK_NAME
    if _held is not None and Path(_held.name) == path:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - kept open: the lock lives as long as the file stays open
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StateDirBusy(
            f"--state-dir {folder} is in use by another daemon (pid {holder}): give each daemon a folder of its own, "
            "or share video jobs between replicas through --state-url"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _held = handle
