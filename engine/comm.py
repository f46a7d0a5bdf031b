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
    """Step plans over torch.distributed, on the CPU: a gloo group of the same ranks (`plan_group`) carries plans,
    heartbeats and agreements whatever the world's backend, so that under NCCL a plan never makes a round trip
    through device memory (a pageable copy and a stream sync every step) and an idle follower waits on a socket,
    which a dead peer closes, rather than inside an NCCL collective. The rows a shared decode gathers (device
    tensors) go over the world group (`group`).

    One broadcast per step: a fixed-size buffer carries an 8-byte length header and the plan. A plan that does not
    fit (long prompts) follows in a second broadcast of exactly the missing bytes.
    """

    HEADER = 8

    def __init__(
        self,
        *,
        device: str = "cpu",
        buffer_bytes: int = 4096,
        group=None,
        plan_group=None,
        faults: FaultBoard | None = None,
    ) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.group = group
        self.plan_group = plan_group if plan_group is not None else group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)
        self.capacity = buffer_bytes - self.HEADER
        self._buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)  # host memory: plans never touch the device
        self.faults = faults
        self.plans = 0  # broadcasts made (tests, benchmarks)

    def broadcast(self, data: bytes | None) -> bytes:
        torch, group = self._torch, self.plan_group
        self.plans += 1
        try:
            if self.rank == 0:
                assert data is not None
                head = len(data).to_bytes(self.HEADER, "little") + data[: self.capacity]
                self._buffer[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                self._dist.broadcast(self._buffer, src=0, group=group)
                rest = data[self.capacity :]
                if rest:
                    self._dist.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=group)
                return data
            self._dist.broadcast(self._buffer, src=0, group=group)
            first = self._buffer[: self.HEADER + self.capacity].numpy().tobytes()
            size = int.from_bytes(first[: self.HEADER], "little")
            if size <= self.capacity:
                return first[self.HEADER : self.HEADER + size]
            extra = torch.empty(size - self.capacity, dtype=torch.uint8)
            self._dist.broadcast(extra, src=0, group=group)
            return first[self.HEADER :] + extra.numpy().tobytes()
        except Exception as exc:
            raise CommError(f"plan broadcast failed on rank {self.rank}: {exc}") from exc

    def agree(self, flags: list[int]) -> list[int]:
        torch = self._torch
        try:
            tensor = torch.tensor(flags, dtype=torch.int32)
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.plan_group)
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
