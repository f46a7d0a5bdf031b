"""How a step plan reaches every rank. The engine always moves bytes through a communicator, so a world of one runs
the same path as N ranks."""

from __future__ import annotations

from typing import Protocol


class Communicator(Protocol):
    rank: int
    world_size: int

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0 passes the plan's bytes; every rank gets them back."""
        ...


class LocalComm:
    """A world of one."""

    rank = 0
    world_size = 1

    def broadcast(self, data: bytes | None) -> bytes:
        assert data is not None
        return data
