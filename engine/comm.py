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


class CommError(RuntimeError):
    """A collective failed: a rank died or the group broke. Never a single request's fault."""


class TorchComm:
    """Step plans over torch.distributed: gloo on CPU, NCCL with a device buffer on GPU.

    One broadcast per step: a fixed-size buffer carries an 8-byte length header and the plan. A plan that does not
    fit (long prompts) follows in a second broadcast of exactly the missing bytes.
    """

    HEADER = 8

    def __init__(self, *, device: str = "cpu", buffer_bytes: int = 4096, group=None) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)
        self.capacity = buffer_bytes - self.HEADER
        self._buffer = torch.zeros(buffer_bytes, dtype=torch.uint8, device=self.device)

    def broadcast(self, data: bytes | None) -> bytes:
        torch = self._torch
        try:
            if self.rank == 0:
                assert data is not None
                head = len(data).to_bytes(self.HEADER, "little") + data[: self.capacity]
                self._buffer[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                self._dist.broadcast(self._buffer, src=0, group=self.group)
                rest = data[self.capacity :]
                if rest:
                    extra = torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(self.device)
                    self._dist.broadcast(extra, src=0, group=self.group)
                return data
            self._dist.broadcast(self._buffer, src=0, group=self.group)
            first = self._buffer[: self.HEADER + self.capacity].cpu().numpy().tobytes()
            size = int.from_bytes(first[: self.HEADER], "little")
            if size <= self.capacity:
                return first[self.HEADER : self.HEADER + size]
            extra = torch.empty(size - self.capacity, dtype=torch.uint8, device=self.device)
            self._dist.broadcast(extra, src=0, group=self.group)
            return first[self.HEADER :] + extra.cpu().numpy().tobytes()
        except Exception as exc:
            raise CommError(f"plan broadcast failed on rank {self.rank}: {exc}") from exc
