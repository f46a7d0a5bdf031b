"""Plans cross between ranks as host bytes over gloo, whatever the world's backend (engine/comm.py, issue 31): under
NCCL a plan never makes a round trip through device memory. On this CPU-only torch any tensor sent to "cuda" raises,
so a communicator of a CUDA rank that moves its plans or agreements through the device fails here. Broken on
purpose once: with the plan buffer back on `device`, the communicator could not even be made."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from diffusiond.engine.comm import TorchComm
from diffusiond.engine.wire import StepPlan, decode_plan, encode_plan


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def test_a_cuda_ranks_plans_never_touch_the_device(world_of_one):
    assert not torch.cuda.is_available()
    comm = TorchComm(device="cuda:0", plan_group=world_of_one, buffer_bytes=256)
    long = StepPlan(step=3, advance=[f"request-{i}" for i in range(100)])  # past the buffer: a second broadcast
    for plan in (StepPlan(step=1), long):
        assert decode_plan(comm.broadcast(encode_plan(plan))) == plan
    assert comm.agree([0, 2, 1]) == [0, 2, 1]
    assert comm.plans == 2
