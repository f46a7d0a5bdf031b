"""Stage timers: wall time on the CPU; CUDA events, read back without a sync, on a GPU."""

import time

import pytest
import torch

from diffusiond.engine.timing import CudaStages, HostStages, stage_timer


def test_host_stages_add_up_and_reset():
    timer = stage_timer("cpu")
    assert isinstance(timer, HostStages)
    with timer.stage("denoise"):
        time.sleep(0.01)
    with timer.stage("denoise"):
        time.sleep(0.01)
    with timer.stage("decode"):
        pass
    times = timer.collect()
    assert set(times) == {"denoise", "decode"} and times["denoise"] >= 0.02
    assert timer.collect() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stages_time_the_gpu_work_not_the_launch():
    timer = stage_timer("cuda")
    assert isinstance(timer, CudaStages)
    x = torch.randn(4096, 4096, device="cuda")
    with timer.stage("denoise"):
        for _ in range(20):
            x = x @ x / 64
    launched = timer.collect()  # likely empty: the GPU is still busy, and collect() must not wait for it
    torch.cuda.synchronize()
    done = timer.collect()
    assert "denoise" in {**launched, **done} and {**launched, **done}["denoise"] > 0.001
