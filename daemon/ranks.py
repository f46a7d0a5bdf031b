"""One SPMD rank: join the group and build the model with its share of the parallel layout; then it drives (rank 0)
or follows.

Used by `diffusiond serve` under torchrun / our elastic launch, and by the SPMD tests.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import sys
from dataclasses import dataclass, replace
from typing import NoReturn

import msgspec
import torch
import torch.distributed as dist

from diffusiond.engine.comm import TorchComm
from diffusiond.engine.fault_board import FaultBoard
from diffusiond.models.base import ModelAdapter
from diffusiond.models.loading.setup import ModelSetup, build_adapter, check_setup

# Long enough for rank 0 to load and warm up while followers wait in their first broadcast; heartbeats keep idle
# groups well inside it.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass
class Rank:
    rank: int
    world_size: int
    adapter: ModelAdapter
    comm: TorchComm


def join_group(setup: ModelSetup) -> Rank:
    """This process's rank (RANK, WORLD_SIZE and MASTER_* from torchrun or our launch): the group joined, its model
    built (models/loading/setup.py `build_adapter`: its share of the layout), its communicator."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup = msgspec.structs.replace(setup, layout=replace(setup.layout, world_size=world_size))
    check_setup(setup)  # before the group forms: a layout that cannot run fails here, on every rank alike
    device = setup.device
    device_id = None
    if device.startswith("cuda"):
        device = cuda_device(device)
        device_id = torch.device(device)
        torch.cuda.set_device(device_id)
        backend = "nccl"
    else:
        backend = "gloo"
    # device_id: NCCL's communicator is made now, bound to this rank's GPU, not lazily at the first collective.
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device_id)
    # Plans, heartbeats and agreements: host bytes over gloo, whatever the world's backend (engine/comm.py).
    plans = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    attempt = agree_on_attempt(plans)
    adapter = build_adapter(msgspec.structs.replace(setup, device=device), rank)
    comm = TorchComm(device=device, plan_group=plans, faults=FaultBoard.from_env(attempt))
    return Rank(rank, world_size, adapter, comm)


def cuda_device(device: str) -> str:
    """This rank's GPU: LOCAL_RANK's among those visible. A launcher that gives each rank one GPU of its own
    (CUDA_VISIBLE_DEVICES per rank) leaves every rank seeing "cuda:0"."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count()
    if visible == 0:
        raise RuntimeError(f"--device {device}: no CUDA device is visible to rank {os.environ.get('RANK')}")
    if visible == 1:
        return "cuda:0"
    if local_rank >= visible:
        raise RuntimeError(
            f"rank {os.environ.get('RANK')} (local rank {local_rank}) has no GPU of its own: {visible} are visible "
            "on this node; start at most that many ranks per node (--nproc)"
        )
    return f"cuda:{local_rank}"


def agree_on_attempt(group) -> str:
    """A name for this incarnation of the group, from rank 0 (over the gloo `group`). The agents' restart counts
    cannot serve: on several nodes they differ (a replaced node's agent starts again from 0), so keys of one attempt
    could meet another's."""
    nonce = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.broadcast(nonce, 0, group=group)
    return f"{int(nonce.item()):x}"


def leave(code: int) -> NoReturn:
    """Ends a rank's process without finalizing the interpreter. Gloo's worker threads release the tensors of
    finished collectives on their own; when such a release is the last reference while Python finalizes, the thread
    needs the GIL, Python ends it with `pthread_exit`, whose unwinding crosses a `noexcept` frame of
    `ProcessGroupGloo::runLoop`: "terminate called without an active exception", SIGABRT, and an exit status of -6
    after a run that went well (measured: 1 exit in 5 with 2 ranks here, `destroy_process_group` or not). Everything
    a rank writes is written by now; logs and standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing more to say
            stream.flush()
    os._exit(code)
