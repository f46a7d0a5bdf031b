"""Run under torch.distributed.run: rank 0 drives an Engine over a TorchComm, the others follow. Rank 0 writes each
request's image to OUT/<index>.npy. Arguments: MODEL OUT CFG_PARALLEL ULYSSES REQUESTS_JSON."""

import asyncio
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from diffusiond.daemon.ranks import join_group
from diffusiond.engine.engine import Engine
from diffusiond.engine.follower import run_follower
from diffusiond.engine.outputs import Completed
from diffusiond.engine.request import SamplingParams


async def drive(rank, requests, out: Path) -> None:
    engine = Engine(rank.adapter, max_batch=8, comm=rank.comm)
    await engine.start()
    try:
        handles = [engine.add_request(p) for p in requests]
        for i, handle in enumerate(handles):
            result = await handle.result()
            assert isinstance(result, Completed), result
            np.save(out / f"{i}.npy", result.image)
    finally:
        await engine.stop()


def main() -> None:
    torch.set_num_threads(1)
    model, out, cfg, ulysses, requests_json = sys.argv[1:6]
    requests = msgspec.json.decode(requests_json, type=list[SamplingParams])
    rank = join_group(model, cfg_parallel=int(cfg), ulysses=int(ulysses))
    if rank.rank == 0:
        asyncio.run(drive(rank, requests, Path(out)))
    else:
        run_follower(rank.adapter, rank.comm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
