"""Host memory: small host values (row indices, per-row scales) sent to the device without a host-device sync,
and freed memory given back to the system.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the copy, which waits for the
stream: a sync per call. Built on the host and sent with `non_blocking=True`, the copy is queued behind the work
already on the stream and the host goes on (STYLE.md: no syncs on the hot path).

glibc keeps what a process frees in its arenas for reuse (and past its first large frees it serves allocations of up
to 32 MB from them, not from mappings of their own), so after loading a model in parts or a burst of large batches
the resident size stays near its high-water mark though little is live. `malloc_trim(0)` returns every arena's free
pages: ~2 ms when there is nothing to return, ~20 ms for 370 MB (measured here).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


@functools.cache
def malloc_trim() -> Callable[[], object] | None:
    """`malloc_trim(0)`, or None where the C library has none (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        log.info("this C library has no malloc_trim: freed memory stays with the process until it is reused")
        return None
    trim.argtypes = [ctypes.c_size_t]
    return functools.partial(trim, 0)


# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations from this size up get mappings of their own under `map_large_allocations`.
MAPPED_FROM = 4 << 20
# glibc's own trim threshold, which `map_large_allocations` restores.
GLIBC_TRIM_THRESHOLD = 128 << 10
# Under `keep_freed_memory`: allocations below this come from the arenas (glibc's largest mapping threshold on 64-bit),
# and the arenas keep up to this much free memory at their top.
ARENA_UP_TO = 32 << 20
KEPT_FREE = 256 << 20
# Where an operator chose the allocator's settings (or another allocator), `keep_freed_memory` leaves them.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _mallopt() -> Callable[[int, int], int] | None:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def keep_freed_memory() -> bool:
    """A step's freed buffers stay with the process for the next step: allocations under ARENA_UP_TO come from the
    arenas, which keep up to KEPT_FREE free at their top (glibc's defaults: a threshold that starts at 128 KB and
    rises, and a heap top given back past twice it). A batched forward frees its activations and the next one
    allocates them again; given back, each page faults in again, and both torch threads fault at once. Measured
    here (tiny SD3, 256x256, 8 CFG requests a forward, on a thread that is not the main one, as the step thread):
    2300-2800 faults and 24-49 ms of system time a step, a step 50-96 ms; kept, 290-310 faults, 2-4 ms, 38.5-39.7
    ms. The engine's idle trim (engine/memory.py) gives the kept memory back once work stops. Left alone where the
    environment sets malloc's settings (GLIBC_TUNABLES, MALLOC_*_) or the C library has no mallopt; False then."""
    import os

    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(k in os.environ for k in MALLOC_ENV):
        return False
    if (mallopt := _mallopt()) is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, ARENA_UP_TO)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE))


def map_large_allocations(threshold: int = MAPPED_FROM) -> bool:
    """Every allocation of `threshold` bytes or more gets a mapping of its own, returned to the system when freed
    (glibc's `mallopt(M_MMAP_THRESHOLD)`; setting it also ends the dynamic threshold that rises to 32 MB). For
    FSDP-sharded weights: each forward gathers a block's weights into new tensors of 1-20 MB and frees them, and
    glibc served those from its arenas, whose freed pages stayed resident; at SD3.5-medium size on 2 CPU ranks
    (1x2) each rank's peak then reached a whole model's (5.6 GB, 1.00x of one process), 3.8 GB with this. False
    where the C library has no mallopt. The arenas' trim threshold goes back to glibc's own (`keep_freed_memory`
    raises it)."""
    if (mallopt := _mallopt()) is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD))


def give_back() -> None:
    """Freed memory back to the system, where the C library can."""
    if (trim := malloc_trim()) is not None:
        trim()


def to_device(values: Sequence[float] | Sequence[int], device: torch.device | str, dtype=None) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)


MADV_DONTNEED = 4


def drop_file_pages(folder: str) -> int:
    """Pages of this process's mappings of files under `folder` (a checkpoint's safetensors, mapped by loading)
    taken off its page tables; the bytes those mappings span. The pages stay in the page cache, and a tensor still
    viewing the file reads them again at its next touch. Only for files mapped to be read: a page written through
    a private mapping would be lost. 0 where /proc or madvise is missing."""
    import os
    from pathlib import Path

    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    prefix = os.path.realpath(folder) + os.sep
    released = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start, MADV_DONTNEED) == 0:
                released += end - start
    return released
