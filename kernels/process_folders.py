"""Folders that belong to a process: named `<prefix><pid>-<random>`, so that when the process dies without removing
its folder (SIGKILL, the OOM killer) the next process of the same kind removes it. Used for the launcher's kept
weights in shared memory (models/loading/kept_weights.py) and a daemon's temporary video folder
(daemon/video_store.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def new_folder(parent: Path, prefix: str) -> Path:
    """A new folder under `parent` named after this process (mode 0700)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def remove_dead(parent: Path, prefix: str) -> int:
    """Remove the folders under `parent` named `<prefix><pid>-...` whose process is gone; how many went. What cannot
    be removed (another user's) stays."""
    removed = 0
    for folder in parent.glob(f"{prefix}*"):
        pid = folder.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed += not folder.exists()
    return removed


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
