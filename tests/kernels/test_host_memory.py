"""Large host allocations mapped on their own (kernels/host.py `map_large_allocations`, set under --shard-weights):
freed, they leave the resident set at once.

What FSDP-sharded weights do each forward, in small: a tensor past glibc's mapping threshold is freed (the threshold
rises to its size), then a block's worth of 8 MB tensors is made beside small ones that stay, and freed. From the
arenas (the default), the freed 8 MB pieces sit between live ones and stay resident; mapped, they go back. Each case
runs in a process of its own (the setting is the process's). Broken on purpose (the call made a no-op): the mapped
case kept its 320 MB, red."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import re, sys
import torch
from diffusiond.kernels.host import map_large_allocations

def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10

if sys.argv[1] == "mapped":
    assert map_large_allocations()
first = torch.ones(24 << 20, dtype=torch.uint8)  # mapped by default, and freed: the threshold rises past 8 MB
del first
before = anon()
small, large = [], []
for _ in range(40):
    large.append(torch.ones(8 << 20, dtype=torch.uint8))  # a gathered weight
    small.append(torch.ones(64 << 10, dtype=torch.uint8))  # what outlives it
large.clear()
print(anon() - before)
"""


def kept_after_free(case: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_freed_large_tensors_leave_the_resident_set_when_mapped():
    assert kept_after_free("arenas") > 200 << 20  # glibc's default: the freed 8 MB pieces stay resident
    assert kept_after_free("mapped") < 40 << 20
