"""The fault board: how a rank tells rank 0 it hit an error fatal to the group, outside the collectives."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class FaultBoard:
    """Faults reported through the group's key-value store (the rendezvous TCPStore), not through a collective.

    A rank that fails inside a collective step leaves the others waiting in that collective: with gloo its exit
    breaks their sockets at once, but NCCL only notices at its timeout (minutes). Rank 0's engine polls this board
    between heartbeats and during steps, so it fails its requests within a second whatever the backend. Keys carry the
    group's attempt (a name rank 0 gives each incarnation of the group), so a fault of an earlier attempt never
    poisons the next group (torchrun's shared store outlives it)."""

    KEY = "fault"

    def __init__(self, store: Any, attempt: str = "0") -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"diffusiond/attempt-{attempt}/", store)

    @classmethod
    def from_env(cls, attempt: str = "0") -> FaultBoard | None:
        """A client of the store at MASTER_ADDR:MASTER_PORT (torchrun and our launcher host one there)."""
        import datetime

        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        try:
            store = dist.TCPStore(
                addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
            )
        except Exception as exc:
            log.warning("no fault board (store at %s:%s unreachable: %s)", addr, port, exc)
            return None
        return cls(store, attempt)

    def report(self, message: str) -> None:
        try:
            self.store.set(self.KEY, message)
        except Exception as exc:
            log.warning("could not report the fault to rank 0: %s", exc)

    def read(self) -> str | None:
        try:
            if self.store.check([self.KEY]):
                return self.store.get(self.KEY).decode(errors="replace")
        except Exception:
            # The store lives with rank 0 or the agent: unreachable means the group is going down anyway.
            return None
        return None
