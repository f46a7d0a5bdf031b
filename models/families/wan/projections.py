"""Exact conditioning projection reuse: key/value projections of a request's conditioning (text, image) are the same
at every step, so they are computed once at admission and reused for every step of the request.

An entry is keyed on what decides its value and nothing else: the conditioning tensor's bytes (a digest, so two
requests with the same prompt share one entry, and two prompts never do) and the identity and in-place version of
every weight that produced it (a weight changed in place, by a fused LoRA say, bumps `Tensor._version`, so old
entries stop matching). Never the timestep or the step: the projections do not depend on them.

Entries are bounded in bytes. A request holds its entries until it ends (`release`); entries in use are never
evicted, and a request whose entry does not fit runs without reuse (its rows are projected every step).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

import torch

# Per model: real Wan 2.1 14B holds 40 blocks x 512 tokens x 5120 x 2 (key, value) x 2 bytes = 420 MB per text row;
# the 1.3B model 40 MB. A quarter of this budget per row would still leave 4 requests with CFG.
DEFAULT_BUDGET_BYTES = 2 << 30


def tensor_digest(t: torch.Tensor) -> bytes:
    """A digest of the tensor's dtype, shape and bytes (one host copy, at admission only)."""
    t = t.detach().contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.digest()


def weights_version(params: Iterable[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((id(p), p._version) for p in params)


class Entry:
    __slots__ = ("key", "nbytes", "tensors", "users")

    def __init__(self, key: Hashable, tensors: tuple[torch.Tensor, ...]) -> None:
        self.key = key
        self.tensors = tensors
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.users = 0


class ProjectionCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()

    def acquire(self, key: Hashable, compute: Callable[[], tuple[torch.Tensor, ...]]) -> Entry | None:
        """The entry for `key` (computed on a miss), held for the caller until `release`; None when it cannot fit
        in the budget beside the entries in use."""
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        else:
            self.misses += 1
            entry = Entry(key, compute())
            if not self._make_room(entry.nbytes):
                return None
            self._entries[key] = entry
            self.bytes += entry.nbytes
        entry.users += 1
        return entry

    def release(self, entry: Entry) -> None:
        entry.users -= 1

    def _make_room(self, nbytes: int) -> bool:
        if self.bytes + nbytes <= self.budget:
            return True
        for key in [k for k, e in self._entries.items() if e.users == 0]:  # least recently used first
            self.bytes -= self._entries.pop(key).nbytes
            if self.bytes + nbytes <= self.budget:
                return True
        return False

    def __len__(self) -> int:
        return len(self._entries)
