"""How a step plan reaches every rank. The engine always moves bytes through a communicator, so a world of one runs
the same path as N ranks."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from diffusiond.engine.fault_board import FaultBoard
from diffusiond.kernels.collectives import CommError

log = logging.getLogger(__name__)


class Communicator(Protocol):
    rank: int
    world_size: int

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0 passes the plan's bytes; every rank gets them back."""
        ...

    def agree(self, flags: list[int]) -> list[int]:
        """Elementwise maximum of `flags` over all ranks. A collective: every rank calls it with as many flags."""
        ...

    def report_fault(self, message: str) -> None:
        """Tell rank 0, outside the collectives, that this rank hit an error fatal to the group."""
        ...

    def gather_rows(self, local: Any, counts: list[int]) -> Any:
        """A collective: rank r passes `counts[r]` rows (>= 1; the same row shape on every rank); rank 0 gets all
        rows in rank order, the others None."""
        ...

    def fault(self) -> str | None:
        """A fault another rank reported, if any (rank 0 polls this while a step may hang in a collective)."""
        ...


class LocalComm:
    """A world of one."""

    rank = 0
    world_size = 1

    def broadcast(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def agree(self, flags: list[int]) -> list[int]:
        return flags

    def report_fault(self, message: str) -> None:
        pass

    def fault(self) -> str | None:
        return None

    def gather_rows(self, local: Any, counts: list[int]) -> Any:
        return local


class TorchComm:
    """Step plans over torch.distributed: gloo on CPU, NCCL with a device buffer on GPU.

    One broadcast per step: a fixed-size buffer carries an 8-byte length header and the plan. A plan that does not
    fit (long prompts) follows in a second broadcast of exactly the missing bytes.
    """

    HEADER = 8

    def __init__(
        self, *, device: str = "cpu", buffer_bytes: int = 4096, group=None, faults: FaultBoard | None = None
    ) -> None:
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
        self.faults = faults

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

    def agree(self, flags: list[int]) -> list[int]:
        torch = self._torch
        try:
            tensor = torch.tensor(flags, dtype=torch.int32).to(self.device)
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.group)
            return tensor.tolist()
        except Exception as exc:
            raise CommError(f"agreement failed on rank {self.rank}: {exc}") from exc

    def report_fault(self, message: str) -> None:
        if self.faults is not None:
            self.faults.report(message)

    def fault(self) -> str | None:
        return self.faults.read() if self.faults is not None else None

    def gather_rows(self, local, counts: list[int]):
        torch = self._torch
        most = max(counts)
        try:
            if local.shape[0] < most:  # equal sizes for the collective
                local = torch.cat([local, local.new_zeros((most - local.shape[0], *local.shape[1:]))])
            local = local.contiguous()
            parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
            self._dist.gather(local, parts, dst=0, group=self.group)
        except Exception as exc:
            raise CommError(f"gather failed on rank {self.rank}: {exc}") from exc
        if parts is None:
            return None
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])
