"""One SPMD rank: join the group, load the model, apply the parallel layout, then either drive (rank 0) or follow.

Used by `diffusiond serve` under torchrun / our elastic launch, and by the SPMD tests.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from diffusiond.engine.comm import FaultBoard, TorchComm
from diffusiond.kernels.parallel import ParallelLayout, build_groups
from diffusiond.models.base import ModelAdapter
from diffusiond.models.loader import load_adapter
from diffusiond.models.lora import DEFAULT_BUDGET_BYTES as DEFAULT_LORA_BUDGET
from diffusiond.models.lora import setup_loras

# Long enough for rank 0 to load and warm up while followers wait in their first broadcast; heartbeats keep idle
# groups well inside it.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass
class Rank:
    rank: int
    world_size: int
    adapter: ModelAdapter
    comm: TorchComm


def in_launched_group() -> bool:
    """True under torchrun or our elastic launch (the agent sets these for every worker)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def join_group(
    model: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    cfg_parallel: int = 1,
    ulysses: int = 1,
    ring: int = 1,
    tp: int = 1,
    shard_weights: bool = False,
    vae_parallel: int = 1,
    quantize: str = "none",
    quantize_skip: str | None = None,
    offload: str = "none",
    scheduler_config: Mapping[str, Any] | None = None,
    loras: Sequence[tuple[str, str]] = (),
    lora_budget: int = DEFAULT_LORA_BUDGET,
    lora_fuse: float | None = None,
    lora_refusal: str | None = None,
) -> Rank:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = ParallelLayout(world_size, cfg_parallel, ulysses, ring, tp)
    layout.validate()
    if device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    attempt = agree_on_attempt(device)
    adapter = load_adapter(
        model,
        device=device,
        dtype=dtype,
        quantize=quantize,
        quantize_skip=quantize_skip,
        offload=offload,
        scheduler_config=scheduler_config,
    )
    # Before the parallel layout: read through the whole model, as every rank's registry will keep doing.
    setup_loras(adapter, loras, lora_budget, lora_fuse, lora_refusal)
    groups = build_groups(layout, rank, torch.device(device).type, vae_parallel)
    for degree, flag, strategy in (
        (ring, "--ring", "ring"),
        (tp, "--tp", "tp"),
        (vae_parallel, "--vae-parallel", "vae-parallel"),
    ):
        if degree > 1 and strategy not in adapter.parallel:
            raise ValueError(f"{flag} {degree}: the {adapter.family} family does not support {strategy}")
    if groups.tp is not None:  # first: sharding replaces the linears the other strategies' processors call
        adapter.enable_tp(groups.tp)
    if shard_weights:
        if groups.tp is not None:
            raise ValueError("--shard-weights with --tp: shard over one of them (HSDP x TP is not built yet)")
        from torch.distributed.device_mesh import init_device_mesh

        adapter.enable_shard_weights(init_device_mesh(torch.device(device).type, (world_size,)))
    if groups.vae is not None:
        adapter.enable_vae_parallel(groups.vae)
    if world_size > 1:  # prompts: rank 0 encodes, the others receive the embeddings and free their text encoders
        from diffusiond.kernels.collectives import SharedEncoding

        adapter.enable_encode_once(SharedEncoding(dist.group.WORLD, rank, torch.device(device)))
    if groups.cfg is not None:
        adapter.enable_cfg_parallel(groups.cfg)
    if groups.sequence is not None:
        adapter.enable_ulysses(groups.sequence)
    return Rank(rank, world_size, adapter, TorchComm(device=device, faults=FaultBoard.from_env(attempt)))


def agree_on_attempt(device: str) -> str:
    """A name for this incarnation of the group, from rank 0. The agents' restart counts cannot serve: on several
    nodes they differ (a replaced node's agent starts again from 0), so keys of one attempt could meet another's."""
    nonce = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0], dtype=torch.int64, device=device)
    dist.broadcast(nonce, 0)
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
