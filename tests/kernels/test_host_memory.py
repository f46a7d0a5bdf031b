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


KEPT_SCRIPT = """
import re, resource, sys, threading
import torch
from diffusiond.kernels.host import give_back, keep_freed_memory

def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10

kept = keep_freed_memory() if sys.argv[1] != "default" else None
if sys.argv[1] == "setting":
    print(kept, 0, 0)
    sys.exit()
torch.set_num_threads(1)
torch.manual_seed(0)
layers = [(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 64)) for _ in range(4)]
net = torch.nn.Sequential(*[m for block in layers for m in block])
x = torch.randn(4096, 64)  # activations of 16 MB: under glibc's largest mapping threshold
out = {}

def steps():  # on a thread of its own, as the engine's step thread
    with torch.inference_mode():
        for _ in range(3):
            net(x)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(10):
            net(x)
    out["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    start = anon()
    give_back()
    out["given_back"] = start - anon()

thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(kept, out["faults"], out["given_back"])
"""


def run_steps(case: str, **env: str) -> tuple[str, int, int]:
    import os

    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", KEPT_SCRIPT, case], capture_output=True, text=True, check=True, env={**environ, **env}
    )
    kept, faults, given_back = out.stdout.split()
    return kept, int(faults), int(given_back)


def test_a_steps_freed_memory_is_kept_for_the_next_step_until_given_back():
    """`keep_freed_memory` (set by every command that runs steps): 10 forwards of a small MLP whose activations are
    16 MB fault their pages in again by default (glibc gives its heap's top back past twice its threshold: measured
    37,000 faults alone, 8,195 in a CI run beside the other worker), and not once kept; the kept memory goes back
    with `give_back` (the engine's idle trim). Broken on purpose (the call made a no-op): red."""
    assert run_steps("default")[1] > 5_000
    kept, faults, given_back = run_steps("kept")
    assert kept == "True"
    assert faults < 2_000, faults
    assert given_back > 16 << 20, given_back


def test_an_operators_malloc_settings_are_left_alone():
    assert run_steps("setting")[0] == "True"
    assert run_steps("setting", GLIBC_TUNABLES="glibc.malloc.trim_threshold=65536")[0] == "False"
    assert run_steps("setting", MALLOC_TRIM_THRESHOLD_="65536")[0] == "False"
